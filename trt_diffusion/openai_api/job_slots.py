"""Interactive before batch (docs/deploy.md): the API's jobs (batch lines and videos) reach Triton at the batch
priority level (the entry's dynamic batcher serves every queued interactive request first: triton/configs.py) and
carry the request parameter trt_diffusion_priority=batch. A job line starts only when it leaves one of the model's
instances to people: while this API's online requests in flight on the model are fewer than its instances minus one
(one instance: none in flight). The runner runs one line at a time, so jobs hold at most one instance, never the
last of several. A running line is not killed when a person's request arrives on another instance: it yields, the
entry holding it back between engine calls (denoising steps) until no person's request runs on the pipeline's
other instances of that server (triton/backend/activity.py), so the two do not share the CPU (GPU)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from ..triton.configs import PRIORITY_BATCH
from ..triton.contract import PRIORITY_BATCH_VALUE, PRIORITY_PARAMETER

INSTANCES_MAX_AGE_S = 5.0


class BatchPriorityClient:
    """A Triton gRPC client whose inferences go at the batch priority level, marked as a job's (the request
    parameter the entry yields by, beside the caller's parameters), with the jobs' own deadline `timeout_s` (the
    API's --job-timeout, in place of the online --timeout the caller gives: a job's request that yields to people
    is not failed for it); everything else as the client."""

    def __init__(self, client, timeout_s: float | None = None):
        self._client = client
        self.timeout_s = timeout_s

    async def infer(self, *args, **kwargs):
        kwargs.setdefault("priority", PRIORITY_BATCH)
        if self.timeout_s is not None:
            kwargs["client_timeout"] = self.timeout_s
        kwargs["parameters"] = {**(kwargs.get("parameters") or {}), PRIORITY_PARAMETER: PRIORITY_BATCH_VALUE}
        return await self._client.infer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


class JobSlots:
    def __init__(self, client, clock: Callable[[], float] = time.monotonic):
        self.client = client
        self.clock = clock
        self.online: Counter = Counter()  # model -> this API's online requests in Triton now
        self._instances: dict[str, tuple[float, int]] = {}
        self.on_leave: Callable[[], None] = lambda: None

    def enter(self, model: str) -> None:
        self.online[model] += 1

    def leave(self, model: str) -> None:
        self.online[model] -= 1
        self.on_leave()  # a waiting job may start now

    async def instances(self, model: str) -> int:
        read_at, count = self._instances.get(model, (None, 0))
        if read_at is None or self.clock() - read_at > INSTANCES_MAX_AGE_S:
            config = (await self.client.get_model_config(model)).config
            count = max(sum(group.count for group in config.instance_group), 1)
            self._instances[model] = (self.clock(), count)
        return count

    def known_instances(self, model: str) -> int:
        """The instance count last read (`instances`), 1 before the first read: the overload gate's divisor."""
        return self._instances.get(model, (None, 1))[1]

    async def free(self, model: str | None) -> bool:
        """Whether a job line for `model` may start now (None, or a model Triton does not know: yes — the line
        then fails with the online route's own message)."""
        if model is None:
            return True
        try:
            instances = await self.instances(model)
        except Exception:  # noqa: BLE001 - the line's own call reports what is wrong
            return True
        online = self.online[model]
        return online == 0 if instances == 1 else online < instances - 1
