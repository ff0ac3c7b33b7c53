"""apis._compat: what differs between torch releases, asked of the installed torch."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
from fake_world import fake_mesh
from torch.distributed.device_mesh import DeviceMesh, _mesh_resources

from torchcontract.apis._compat import root_mesh


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A 2 x 2 mesh named (dp, tp) over the fake backend, this process being rank 0."""
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        yield mesh


def test_the_root_of_a_slice_is_the_mesh_it_was_sliced_from(mesh: DeviceMesh) -> None:
    assert root_mesh(mesh["tp"]) is mesh
    assert root_mesh(mesh) is mesh


def test_the_root_is_found_without_torchs_deprecation_warning(mesh: DeviceMesh) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        root_mesh(mesh["dp"])


def test_a_torch_without_the_mesh_method_is_asked_through_mesh_resources(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback for releases whose DeviceMesh has no ``_get_root_mesh`` (2.6)."""
    asked: list[DeviceMesh] = []

    def legacy(sliced: DeviceMesh) -> DeviceMesh:
        asked.append(sliced)
        return mesh

    sliced = mesh["tp"]
    monkeypatch.delattr(DeviceMesh, "_get_root_mesh", raising=False)
    monkeypatch.setattr(_mesh_resources, "get_root_mesh", legacy)
    assert root_mesh(sliced) is mesh
    assert asked == [sliced]
