# The benchmark fixture, as the benchmarks use it.

from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar

_P = ParamSpec("_P")
_T = TypeVar("_T")

class BenchmarkFixture:
    name: str
    fullname: str
    group: str | None
    param: str | None
    extra_info: dict[str, Any]
    def __call__(
        self, function_to_benchmark: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs
    ) -> _T: ...
    def pedantic(
        self,
        target: Callable[..., _T],
        args: tuple[Any, ...] = ...,
        kwargs: Mapping[str, Any] | None = ...,
        setup: Callable[[], tuple[tuple[Any, ...], dict[str, Any]] | None] | None = ...,
        teardown: Callable[..., object] | None = ...,
        rounds: int = ...,
        warmup_rounds: int = ...,
        iterations: int = ...,
    ) -> _T: ...
