"""The NVMe tier's file store: optimizer state kept on a local disk between steps.

A stage whose plan says `offload="nvme"` does not keep its optimizer state in any
memory between steps. The step writes the new state here, array by array and
shard by shard (`pwrite` of each shard's range of a raw file), and hands back, in
the state's place, `NvmeArray` handles: a store, a generation and a key, no bytes.
The next step reads each array from its file, shard by shard, into host memory
(the `pinned_host` layout its update program takes, as under host offload) just
before the stage's update needs it; the program moves it to the devices.

Crash safety. A step writes its state as a new *generation*: a fresh file
`gen-<n>.bin` holding every array at its own aligned offset, fsynced once; only
then is the small manifest (`MANIFEST.json`, the one file a reader trusts)
replaced in one `os.replace` that names the new generation beside the previous
one, and the folder fsynced. A step that dies before the switch leaves
the manifest naming the generation before it, whose file is untouched; the
half-written file is never read (no reader opens a file the manifest does not
name) and is removed by the next write. Every array's CRC-32 is in the manifest and
checked on each read, so a file damaged after its commit is refused, not used. The
store keeps the newest two generations: the state a step returned and the one it
was given (a caller that still holds the older state can read it), and refuses
older handles by name.

One file a generation, not one an array: a step's optimizer state is hundreds of
arrays (two Adam moments per parameter), and a file each cost a flush, an fsync
and, two steps later, an unlink apiece (about 10 ms a step per array on this
machine's disk, measured by profiling a GPT stage), where one file costs them once.

Why raw files and not `np.save` or tensorstore: the arrays' shapes and dtypes are
in the manifest anyway, bfloat16 has no portable `.npy` description, and a raw
file is written with `pwrite` and read through `np.memmap`, any slice of an array,
without a library; tensorstore (already installed with orbax) would add chunked
formats this store does not need.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from hetpar.errors import HetparError

log = logging.getLogger("hetpar.nvme")

MANIFEST = "MANIFEST.json"
KEEP_GENERATIONS = 2  # the state a step returned and the one it was given
_CRC_CHUNK = 64 << 20  # bytes checksummed at a time: a chunk, not the whole file, in memory
_ALIGN = 64  # each array starts on a cache line: any dtype's view of the (page-aligned) map is aligned


class NvmeStateError(HetparError):
    """State on the NVMe tier that cannot be read as valid."""


def _dtype(name: str) -> np.dtype:
    """A dtype from its name, including ML dtypes numpy lacks (bfloat16, float8s)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def _data_file(generation: int) -> str:
    return f"gen-{generation:08d}.bin"


def _fsync_dir(path: Path) -> None:
    """Makes a folder's entries (a new file, a rename) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc(flat: np.ndarray) -> int:
    """CRC-32 of an array's bytes, C order, a chunk at a time."""
    raw = flat.reshape(-1).view(np.uint8) if flat.size else np.zeros(0, np.uint8)
    crc = 0
    for start in range(0, raw.size, _CRC_CHUNK):
        crc = zlib.crc32(raw[start:start + _CRC_CHUNK], crc)
    return crc


def _shards(x: Any) -> Iterable[tuple[tuple[slice, ...], Any]]:
    """An array's distinct pieces as (index into the whole, data): a jax Array's
    addressable shards once per index (replicas skipped), a host array whole."""
    shards = getattr(x, "addressable_shards", None)
    if shards is None:
        yield (slice(None),) * np.ndim(x), x
        return
    if not getattr(x, "is_fully_addressable", True):
        raise NvmeStateError("the NVMe tier keeps state of one process: this array has shards on other processes; "
                             "use host offload (offload='host') under jax.distributed or Ray")
    seen: set = set()
    for shard in shards:
        key = tuple((s.start, s.stop, s.step) for s in shard.index)
        if key not in seen:
            seen.add(key)
            yield shard.index, shard.data


@dataclass(frozen=True, eq=False)
class NvmeArray:
    """An array a step left on the NVMe tier: where it lies, not its bytes. A step of
    the function that returned it reads it (`load`); `np.asarray(handle)`,
    `hetpar.gather` and `hetpar.save_checkpoint` read it whole. JAX operations on it
    need it read first: `jnp.asarray(handle)`."""

    store: "NvmeStore"
    generation: int
    key: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def root(self) -> Path:
        return self.store.root

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def read(self) -> np.ndarray:
        """The whole array in host memory, checked against its manifest entry."""
        return self.store.read(self.generation, self.key)

    def load(self, sharding: Any) -> Any:
        """The array as a jax Array laid out as `sharding` (its memory kind included),
        each shard read from the file on its own."""
        return self.store.load(self.generation, self.key, sharding)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        x = self.read()
        return x if dtype is None else x.astype(dtype)

    def __repr__(self) -> str:
        return f"NvmeArray({self.key}, shape={self.shape}, dtype={self.dtype}, generation {self.generation} at {self.root})"


class NvmeStore:
    """Generations of named arrays under `root`, switched by an atomic manifest. One
    writer per folder (one parallelized function's steps); any number of readers.
    Reads keep the manifest they parsed while its file is the same one (a commit
    replaces the file, so a new inode or time says it changed), and a map of each
    committed generation's file (never written again)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._manifest: tuple[tuple[int, int, int], dict] | None = None  # ((inode, mtime, size), parsed)
        self._maps: dict[int, np.memmap] = {}  # generation -> its file mapped read-only

    @staticmethod
    def temporary() -> "NvmeStore":
        """A store in a fresh folder of the system's temporary directory (`TMPDIR`):
        where state goes when the user names no folder (RuntimeOption.nvme_dir)."""
        return NvmeStore(tempfile.mkdtemp(prefix="hetpar-nvme-"))

    # --- the manifest: the only thing a reader trusts -------------------------------

    def manifest(self) -> dict:
        """The committed generations: {"generation": newest, "generations": {n: {key:
        entry}}}; an empty store has generation 0 and none."""
        path = self.root / MANIFEST
        try:
            st = path.stat()
        except FileNotFoundError:
            return {"generation": 0, "generations": {}}
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._manifest is not None and self._manifest[0] == stamp:
            return self._manifest[1]
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise NvmeStateError(f"the NVMe store's manifest {path} cannot be read ({e}); the state in {self.root} "
                                 "is lost: restore it from a checkpoint") from None
        data["generations"] = {int(g): arrays for g, arrays in data["generations"].items()}
        self._manifest = (stamp, data)
        return data

    @property
    def generation(self) -> int:
        return int(self.manifest()["generation"])

    def handles(self, generation: int | None = None) -> dict[str, NvmeArray]:
        """The arrays of a committed generation (default the newest) as handles: what
        a process resuming after a crash reads its state from."""
        m = self.manifest()
        g = m["generation"] if generation is None else generation
        return {k: self._handle(g, k, e) for k, e in self._entries(m, g).items()}

    def _handle(self, generation: int, key: str, entry: dict) -> NvmeArray:
        return NvmeArray(self, generation, key, tuple(entry["shape"]), _dtype(entry["dtype"]))

    def _entries(self, m: dict, generation: int) -> dict:
        if generation not in m["generations"]:
            kept = sorted(m["generations"])
            raise NvmeStateError(
                f"generation {generation} of the NVMe state in {self.root} is not committed (the store holds "
                f"{kept or 'none'}): it was superseded more than {KEEP_GENERATIONS - 1} step(s) ago, or the step that "
                "wrote it did not finish; use the state the latest step returned")
        return m["generations"][generation]

    # --- writing a generation ----------------------------------------------------------

    def write(self, arrays: dict[str, Any]) -> dict[str, NvmeArray]:
        """Writes `arrays` (jax or numpy arrays by key) as the next generation and
        commits it; returns their handles. Nothing is visible to readers until the
        file is durable and the manifest is switched."""
        writer = self.begin()
        try:
            handles = {key: writer.add(key, x) for key, x in arrays.items()}
        except BaseException:
            writer.abort()
            raise
        writer.commit()
        return handles

    def begin(self, background: bool = False) -> "GenerationWriter":
        """The next generation, open for arrays (`GenerationWriter.add`) until its
        commit; with `background`, each array is written by a worker thread, so the
        caller goes on (a step dispatching its next programs) while the disk works."""
        self.root.mkdir(parents=True, exist_ok=True)
        m = self.manifest()
        return GenerationWriter(self, max([m["generation"], *m["generations"]]) + 1, background)

    def _commit(self, generation: int, entries: dict) -> None:
        """Names `generation` (its file durable) in the manifest beside the one before:
        the one atomic step that makes it what readers get."""
        m = self.manifest()
        kept = sorted([*m["generations"], generation])[-KEEP_GENERATIONS:]
        generations = {**m["generations"], generation: entries}
        new = {"version": 1, "generation": generation, "generations": {str(k): generations[k] for k in kept}}
        tmp = self.root / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps(new, separators=(",", ":")))  # one write: json.dump writes a piece at a time
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / MANIFEST)  # the commit: one atomic rename
        _fsync_dir(self.root)
        self._prune(set(kept))

    def _prune(self, kept: set[int]) -> None:
        """Removes generation files the manifest no longer names (superseded ones, and
        any a dead step left half written)."""
        for g in [g for g in self._maps if g not in kept]:
            del self._maps[g]
        for child in self.root.glob("gen-*.bin"):
            number = child.name.removeprefix("gen-").removesuffix(".bin")
            if number.isdigit() and int(number) not in kept:
                child.unlink(missing_ok=True)

    # --- reading ---------------------------------------------------------------------------

    def _open(self, generation: int, key: str) -> np.ndarray:
        """The array as a read-only view of its generation's file, after checking it
        against the manifest (size, CRC-32)."""
        entry = self._entries(self.manifest(), generation).get(key)
        if entry is None:
            raise NvmeStateError(f"generation {generation} of the NVMe state in {self.root} has no array {key!r}")
        shape, dtype = tuple(entry["shape"]), _dtype(entry["dtype"])
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not size:
            return np.zeros(shape, dtype)
        whole = self._maps.get(generation)
        if whole is None:
            path = self.root / _data_file(generation)
            if not path.exists():
                raise NvmeStateError(f"{path} is missing: the NVMe state of generation {generation} is lost; restore it "
                                     "from a checkpoint")
            whole = self._maps[generation] = np.memmap(path, dtype=np.uint8, mode="r")
        if entry["offset"] + size > whole.size:
            raise NvmeStateError(f"{self.root / _data_file(generation)} is shorter than its manifest says: the NVMe "
                                 f"state of generation {generation} is damaged; restore it from a checkpoint")
        data = whole[entry["offset"]:entry["offset"] + size].view(dtype).reshape(shape)
        if _crc(data) != entry["crc32"]:
            raise NvmeStateError(f"array {key!r} of {self.root / _data_file(generation)} does not match its checksum: "
                                 f"the NVMe state of generation {generation} is damaged; restore it from a checkpoint")
        return data

    def read(self, generation: int, key: str) -> np.ndarray:
        return np.array(self._open(generation, key))

    def load(self, generation: int, key: str, sharding: Any) -> Any:
        """The array laid out as `sharding`, each device's shard read from the file
        by itself (a slice of the memory map), never the whole array at once."""
        import jax

        data = self._open(generation, key)
        return jax.make_array_from_callback(data.shape, sharding, lambda index: np.array(data[index]))


class GenerationWriter:
    """One generation being written: arrays appended to its file as they come (each at
    a 64-byte boundary), then `commit` makes the file durable and switches the
    manifest to it. Handles `add` returns name the generation before it is committed:
    a reader gets them refused until then (and for good if the step dies first)."""

    def __init__(self, store: NvmeStore, generation: int, background: bool = False):
        self.store, self.generation = store, generation
        self.path = store.root / _data_file(generation)
        self.path.unlink(missing_ok=True)  # a step that died before its commit left it: never read
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._end = 0
        self._entries: dict[str, dict] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hetpar-nvme") if background else None
        self._pending: list[Future] = []

    def add(self, key: str, x: Any) -> NvmeArray:
        """Writes `x` (a jax Array, shard by shard, or a host array) into the
        generation, now or on the worker thread; its handle."""
        shape, dtype = tuple(np.shape(x)), np.dtype(x.dtype)
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        start, self._end = self._end, self._end + -(-size // _ALIGN) * _ALIGN
        entry = self._entries[key] = {"offset": start, "shape": list(shape), "dtype": dtype.name}
        if self._pool is None:
            entry["crc32"] = _write_array(self._fd, start, x)
        else:
            self._pending.append(self._pool.submit(lambda: entry.__setitem__("crc32", _write_array(self._fd, start, x))))
        return NvmeArray(self.store, self.generation, key, shape, dtype)

    def commit(self) -> None:
        """Waits for every write (raising the first that failed, with nothing
        committed), makes the file durable, and switches the manifest to it."""
        try:
            for f in self._pending:
                f.result()
            os.ftruncate(self._fd, self._end)
            os.fsync(self._fd)
        except BaseException:
            self.abort()
            raise
        self._close()
        self.store._commit(self.generation, self._entries)

    def abort(self) -> None:
        """Stops the generation: nothing is committed; its file is removed by the
        next write."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._close()

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _write_array(fd: int, start: int, x: Any) -> int:
    """One array into the file at `start`, in C order; its CRC-32. A jax Array split
    along its first axis only (or not at all) goes shard by shard, each a contiguous
    range of the file; one split otherwise is read whole first (one array in host
    memory at a time)."""
    shape = tuple(np.shape(x))
    pieces = list(_shards(x))
    if len(shape) == 0 or any(any(s != slice(None) and (s.start, s.stop) != (0, n) for s, n in zip(index[1:], shape[1:]))
                              for index, _ in pieces):
        pieces = [((slice(None),) * len(shape), np.asarray(x))]
    row = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(x.dtype).itemsize if shape else 0
    crc = 0
    for index, data in sorted(pieces, key=lambda p: (p[0][0].start or 0) if p[0] else 0):
        raw = np.ascontiguousarray(np.asarray(data)).reshape(-1).view(np.uint8)
        _pwrite_all(fd, raw, start + ((index[0].start or 0) * row if index else 0))
        crc = zlib.crc32(raw, crc)
    return crc


def _pwrite_all(fd: int, raw: np.ndarray, offset: int) -> None:
    """All of `raw` at `offset`: one pwrite moves at most about 2 GiB on Linux."""
    view = memoryview(raw)
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
