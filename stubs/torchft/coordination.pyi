class LighthouseServer:
    def __init__(
        self,
        bind: str,
        min_replicas: int,
        join_timeout_ms: int | None = None,
        quorum_tick_ms: int | None = None,
        heartbeat_timeout_ms: int | None = None,
    ) -> None: ...
    def address(self) -> str: ...
    def shutdown(self) -> None: ...
