"""EngineCore's engine-control methods (vLLM's sleep / wake_up / is_sleeping / collective_rpc).

They are utility calls like any other core method, so they work with the core in this process
and in its own. A function sent to the workers from another process travels pickled
(ember.pickling): `collective_rpc_pickled` takes and returns bytes, and an error raised on
the worker comes back as itself, not as a string.

While the engine sleeps, requests are held: `has_work` is false and `step` schedules nothing,
so a request that another front end sends meanwhile waits for wake_up instead of running on
freed memory. Sleeping needs an idle engine (vLLM leaves that to the caller; here it is checked).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def check_sleep_mode(args, level: int) -> None:
    """vLLM's preconditions of sleep, shared by the front ends (clear errors before a round
    trip) and the core (the authority when several front ends share it)."""
    if not args.enable_sleep_mode:
        raise ValueError("sleep mode is off: create the engine with enable_sleep_mode=True")
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")


class EngineCoreControl:
    """Mixed into EngineCore (which provides executor, scheduler, kv_cache_manager)."""

    sleep_level: int = 0

    def _executor_method(self, name: str) -> Callable[..., Any]:
        method = getattr(self.executor, name, None)  # type: ignore[attr-defined]
        if method is None:
            raise NotImplementedError(
                f"the executor {type(self.executor).__name__} has no {name}()")  # type: ignore[attr-defined]
        return method

    def sleep(self, level: int = 1) -> None:
        """Level 1: drop the KV cache, move weights to host memory; level 2: drop both."""
        check_sleep_mode(self.args, level)  # type: ignore[attr-defined]
        if self.sleep_level:
            return  # already asleep: vLLM's sleep is idempotent too
        if self.scheduler.has_unfinished_requests():  # type: ignore[attr-defined]
            raise RuntimeError("cannot sleep while requests run: wait for them or abort them")
        while self._in_flight is not None:  # type: ignore[attr-defined]
            # Async scheduling planned a step before the last request ended; its tokens go to
            # no one, but it must finish before the memory it uses is freed.
            self.step()  # type: ignore[attr-defined]
        self._executor_method("sleep")(level)
        # The cached blocks' contents are gone with the KV cache.
        self.kv_cache_manager.reset_prefix_cache()  # type: ignore[attr-defined]
        self.sleep_level = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back weights and KV cache (or only those named by tags: "weights", "kv_cache")."""
        if not self.sleep_level:
            return
        self._executor_method("wake_up")(tags)
        control = getattr(self.executor, "control", None)  # type: ignore[attr-defined]
        if control is None or not control.asleep:
            self.sleep_level = 0

    def is_sleeping(self) -> bool:
        return bool(self.sleep_level)

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run `method` on every worker; one result per worker."""
        return self._executor_method("collective_rpc")(method, tuple(args), kwargs)

    def collective_rpc_pickled(self, payload: bytes) -> bytes:
        """collective_rpc for a caller in another process: (method, args, kwargs) pickled in,
        ("ok", results) or ("error", exception) pickled out."""
        from ember.pickling import dumps, loads

        method, args, kwargs = loads(payload)
        try:
            outcome: tuple[str, Any] = ("ok", self.collective_rpc(method, args, kwargs))
        except Exception as exc:
            outcome = ("error", exc)
        try:
            return dumps(outcome, "the collective_rpc result")
        except ValueError as exc:
            return dumps(("error", exc), "the collective_rpc error")
