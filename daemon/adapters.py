"""The LoRA adapters a node serves: every pushed version an immutable name, loaded by each engine through its own
adapter API; the newest ``adapters.keep`` (policy) stay loaded and older ones are unloaded and refused by name.

    PUT /v1/adapters/{base}/{version}   body: adapter_model.safetensors, the PEFT config in its metadata
      1. stage     the body streams into a folder of its own (adapter_config.json + adapter_model.safetensors), the
                   form vLLM reads (it loads from folders only); a body that does not arrive whole leaves nothing
      2. cap       the versions kept plus this one must fit every engine's cap, else 409 naming it (nothing changed)
      3. load      under the node's lock each engine loads ``<base>@<version>``; one failure unloads it everywhere
                   and deletes its folder: the previous version goes on serving
      4. retire    versions beyond ``keep`` are unloaded and their folders deleted (before the load when the cap
                   leaves no room for one more: an engine never passes its cap)

The folders live under ``<journal>.adapters/`` (a temporary directory without a journal), and the journal records
the versions loaded and the names retired: a daemon SIGKILLed and started again names the same current adapter,
refuses the retired names, and deletes any folder of a version it no longer loads. An engine that restarted loads
the kept versions again from their folders.

A folder lives exactly as long as its name is loaded: vLLM re-reads an evicted adapter from it at the next request,
and a missing folder then kills the engine (research/lora-engines.md §1.3.7); deleting it at unload is what makes
a retired name fail on SGLang, which would otherwise re-load it from its cached path. Rollout requests go to the
engines, not through the daemon: the daemon refuses a retired name where it sees one, the engines where they do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import shutil
import struct
import tempfile
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import AdapterRefused, AdapterRetired, NotFound, RequestInvalid, TransitionRejected
from ..policies import AdapterSettings
from .journal import KEEP_RETIRED_ADAPTERS, Journal
from .metrics import Metrics
from .worker import EngineHandle, EngineWorker

__all__ = ["ADAPTER_CONFIG_KEY", "AdapterVersion", "Adapters", "adapter_name"]

log = logging.getLogger("colocd.adapters")

ADAPTER_CONFIG_KEY = "adapter_config"  # the safetensors __metadata__ entry that carries adapter_config.json
_HEADER_MAX = 100 << 20  # safetensors' own limit on the header (safetensors/src/tensor.rs)


def adapter_name(base: str, version: str) -> str:
    """The immutable name a version is served under."""
    return f"{base}@{version}"


@dataclass
class AdapterVersion:
    """One pushed version: its name, its folder and the engines holding it."""

    name: str
    folder: Path
    nbytes: int
    engines: list[str] = field(default_factory=list)
    load_s: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "folder": str(self.folder), "nbytes": self.nbytes, "engines": list(self.engines)}

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> AdapterVersion:
        return cls(str(record["name"]), Path(record["folder"]), int(record["nbytes"]), list(record["engines"]))


class Adapters:
    """``await adapters.push(base, version, body)`` under the node's lock; ``check(name)`` (410 once retired)."""

    def __init__(self, worker: EngineWorker, metrics: Metrics, *, settings: Callable[[], AdapterSettings],
                 exclusive: Callable[[str], contextlib.AbstractAsyncContextManager[None]],
                 journal: Journal) -> None:
        self._worker = worker
        self._engines: Mapping[str, EngineHandle] = worker.engines
        self._metrics = metrics
        self._settings = settings
        self._exclusive = exclusive
        self.loaded: list[AdapterVersion] = []  # oldest first; the last one is current
        self._retired: deque[str] = deque(maxlen=KEEP_RETIRED_ADAPTERS)
        self._unjournaled: list[str] = []  # names retired since the last journal record
        self._journal = journal
        # Absolute: the engines read the folders from their own working directories.
        self.root = Path(f"{journal.path.absolute()}.adapters") if journal.path is not None else None
        self._lingering: list[AdapterVersion] = []  # retired, but an engine failed to unload it: retried

    @property
    def current(self) -> str | None:
        return self.loaded[-1].name if self.loaded else None

    def check(self, name: str) -> dict[str, Any]:
        """Loaded (with whether it is current), else AdapterRetired or NotFound."""
        if any(v.name == name for v in self.loaded):
            return {"name": name, "current": name == self.current, "loaded": True}
        if name in self._retired:
            raise AdapterRetired(f"adapter {name!r} was retired: the engines no longer serve it; request the current "
                                 f"adapter {self.current!r}", current=self.current)
        raise NotFound(f"no adapter {name!r} was pushed to this daemon; current: {self.current!r}")

    def status(self) -> dict[str, Any]:
        return {"current": self.current, "loaded": [v.name for v in self.loaded], "retired": len(self._retired),
                "keep": self._settings().keep, "cap": self._cap()[0],
                "load_s": self.loaded[-1].load_s if self.loaded else {}}

    async def push(self, base: str, version: str, body: AsyncIterator[bytes]) -> dict[str, Any]:
        """Stage the body, then under the node's lock check the cap, load everywhere and retire what falls out."""
        name = adapter_name(base, version)
        self._check_new(name)
        staged = await self._stage(name, body)
        try:
            async with self._exclusive(f"adapter push {name}"):
                self._check_new(name)  # a push of the same name may have committed while this one staged
                try:
                    await self._commit(staged)
                finally:
                    if staged.engines and staged not in self.loaded:  # an engine failed to unload it again:
                        self._lingering.append(staged)  # retried at the next retirement
                        self._retire_name(staged.name)
                    recorded = self._record()  # in the lock: the records follow the changes in order
                await self._journal.written(recorded)  # the reply comes once a restarted daemon would know it
        except BaseException as exc:
            if not staged.engines:
                shutil.rmtree(staged.folder, ignore_errors=True)
            self._metrics.adapter_pushes.labels("refused" if isinstance(exc, TransitionRejected) else "failed").inc()
            raise
        self._metrics.adapter_pushes.labels("committed").inc()
        self._refresh()
        return {"adapter": name, "loaded": [v.name for v in self.loaded], "load_s": staged.load_s}

    def restore_journal(self) -> None:
        """A restarted daemon's adapters, from its journal: the versions loaded and the names retired. Any other
        folder under the root is what the daemon that died left (a body being staged, a version retired): deleted."""
        if self.root is None:
            return
        held = self._journal.adapters()
        self.loaded = [AdapterVersion.from_json(v) for v in held.get("loaded", [])]
        self._lingering = [AdapterVersion.from_json(v) for v in held.get("lingering", [])]
        for version in [*self.loaded, *self._lingering]:  # an engine no longer configured is not asked
            version.engines = [e for e in version.engines if e in self._engines]
        self._retired.extend(held.get("retired", []))
        kept = {v.folder for v in [*self.loaded, *self._lingering]}
        for folder in self.root.iterdir() if self.root.is_dir() else ():
            if folder not in kept:
                shutil.rmtree(folder, ignore_errors=True)
        self._refresh()

    def _record(self) -> concurrent.futures.Future[None]:
        """Journal the versions loaded and lingering, and the names retired since the last record."""
        retired, self._unjournaled = self._unjournaled, []
        return self._journal.record_adapters([v.to_json() for v in self.loaded],
                                             [v.to_json() for v in self._lingering], retired)

    def _retire_name(self, name: str) -> None:
        if name not in self._retired:
            self._retired.append(name)
            self._unjournaled.append(name)

    def _check_new(self, name: str) -> None:
        if any(v.name == name for v in self.loaded) or name in self._retired:
            raise AdapterRefused(f"adapter {name!r} was pushed before: a name is never reused (its engines would "
                                 "serve cached blocks of the old weights); push a new version",
                                 state={"adapter": name})

    async def _stage(self, name: str, body: AsyncIterator[bytes]) -> AdapterVersion:
        """Write the body to a fresh folder, then check it is a whole safetensors file carrying the config."""
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="colocd-adapters-"))
        self.root.mkdir(parents=True, exist_ok=True)
        folder = self.root / f"{name}.{uuid.uuid4().hex[:8]}"
        folder.mkdir()
        try:
            nbytes = 0
            with await asyncio.to_thread(open, folder / "adapter_model.safetensors", "wb") as out:
                async for piece in body:  # a trainer gone mid-body raises here (ClientDisconnect)
                    nbytes += len(piece)
                    await asyncio.to_thread(out.write, piece)
            config = await asyncio.to_thread(_adapter_config, folder / "adapter_model.safetensors", nbytes)
            (folder / "adapter_config.json").write_text(config)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return AdapterVersion(name, folder, nbytes)

    def _cap(self) -> tuple[int | None, str]:
        """The fewest adapters any engine may hold, and who says so."""
        caps = [(e.info.max_adapters, f"engine {n!r}'s own flags") for n, e in self._engines.items()
                if e.info is not None and e.info.max_adapters is not None]
        if (policy := self._settings().max_loaded) is not None:
            caps.append((policy, "the policy's adapters.max_loaded"))
        return min(caps, default=(None, ""), key=lambda c: c[0] or 0)

    async def _commit(self, new: AdapterVersion) -> None:
        keep = self._settings().keep
        kept = self.loaded[-(keep - 1):] if keep > 1 else []
        doomed = [v for v in self.loaded if v not in kept]
        cap, who = self._cap()
        if cap is not None and len(kept) + 1 > cap:
            raise AdapterRefused(
                f"loading {new.name!r} would leave {len(kept) + 1} adapters loaded, over the cap of {cap} "
                f"({who}); set the policy's adapters.keep to {cap} or less, or raise the cap",
                state={"cap": cap, "cap_set_by": who, "keep": keep})
        if detached := [n for n, e in self._engines.items() if e.info is None]:
            raise TransitionRejected(f"engines {detached} are not attached: an adapter must reach every engine")
        room = cap is None or len(self.loaded) + 1 <= cap
        if not room:  # unload first, so no engine ever holds more than its cap
            await self._retire(doomed)
        results = await asyncio.gather(*(self._load(e, new) for e in self._engines.values()), return_exceptions=True)
        if failures := [r for r in results if isinstance(r, BaseException)]:
            await self._unload(new)  # the engines that loaded it forget it again: the previous version serves
            raise failures[0]
        self.loaded.append(new)
        if room:
            await self._retire(doomed)

    async def _load(self, engine: EngineHandle, version: AdapterVersion) -> None:
        started = time.perf_counter()
        await self._worker.load_adapter(engine, version.name, str(version.folder))
        if engine.name not in version.engines:
            version.engines.append(engine.name)
        version.load_s[engine.name] = round(time.perf_counter() - started, 6)
        self._metrics.adapter_load.labels(engine.name).observe(version.load_s[engine.name])

    async def _retire(self, versions: list[AdapterVersion]) -> None:
        """Unload ``versions`` (and any an engine failed to unload before) and refuse their names from now on."""
        for version in [*self._lingering, *versions]:
            await self._unload(version)
            self.loaded = [v for v in self.loaded if v is not version]
            self._retire_name(version.name)
        self._lingering = [v for v in [*self._lingering, *versions] if v.engines]

    async def _unload(self, version: AdapterVersion) -> None:
        """Unload ``version`` wherever it is loaded; its folder goes once no engine holds the name."""
        for name in list(version.engines):
            try:
                await self._worker.unload_adapter(self._engines[name], version.name)
            except Exception as exc:  # logged: the push's own outcome is what the caller needs
                log.warning("engine %r: unloading adapter %r failed: %s", name, version.name, exc)
                continue
            version.engines.remove(name)
            self._metrics.adapter_unloads.labels(name).inc()
        if not version.engines:
            shutil.rmtree(version.folder, ignore_errors=True)

    async def restore(self, engine: EngineHandle) -> None:
        """A restarted engine loads the kept versions again, oldest first; a failure is logged (that name fails)."""
        for version in self.loaded:
            try:
                await self._load(engine, version)
            except Exception as exc:
                log.warning("engine %r: re-loading adapter %r after its restart failed: %s", engine.name,
                            version.name, exc)

    def _refresh(self) -> None:
        m = self._metrics
        m.adapter_info.clear()
        if self.current is not None:
            m.adapter_info.labels(self.current).set(1)
        m.adapter_disk_bytes.set(sum(v.nbytes for v in self.loaded))

    async def aclose(self) -> None:
        """Unload every version and delete the folders; the journal keeps the retired names."""
        try:
            await self._retire(list(reversed(self.loaded)))
            self._lingering = []  # its folder goes with the root: nothing of this daemon re-reads it
            self._record()
        finally:
            if self.root is not None:
                shutil.rmtree(self.root, ignore_errors=True)


def _adapter_config(path: Path, nbytes: int) -> str:
    """adapter_config.json from a safetensors file's metadata; RequestInvalid unless the file is whole and has it."""
    with open(path, "rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        try:
            if not 0 < size <= _HEADER_MAX:
                raise ValueError("no safetensors header")
            header = json.loads(f.read(size))
            tensors = {k: v for k, v in header.items() if k != "__metadata__"}
            end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
            config = json.loads((header.get("__metadata__") or {})[ADAPTER_CONFIG_KEY])
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise RequestInvalid(f"the body is not a safetensors file whose __metadata__ carries "
                                 f"{ADAPTER_CONFIG_KEY!r} (the PEFT adapter_config.json): {exc!r:.200}",
                                 field="body") from None
    if not tensors or 8 + size + end != nbytes or not isinstance(config, dict):
        raise RequestInvalid(f"the body holds {nbytes} bytes and {len(tensors)} tensors; its header describes "
                             f"{8 + size + end} bytes and a config must be a JSON object", field="body")
    return json.dumps(config, indent=2)
