"""The CUDA IPC backend: clear refusals everywhere; on a GPU, real copies between two processes.

CPU: config validation, the metadata wire form, address translation, and the refusal when the
CUDA driver cannot be loaded. GPU (marker `gpu`): a host pool is refused; a decode process
exports its pool and this process writes shuffled pages into it (bit-exact, pool offset inside
a larger allocation, the copy waits for kernels still running on the default stream); bad and
foreign metadata are refused; forget then reconnect; both roles in one process; and whole rooms
through two KVTransferManagers in two processes (plus the corrupt drill's host-to-GPU write).
"""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, replace

import grpc
import pytest
import torch

from orchestrator.config import ClusterConfigError, load_config
from orchestrator.launch.background import REPO
from tests.transfer.helpers import layout, wait_finished
from transfer.backend import BackendError, TransferFaults
from transfer.config import TransferConfig, TransferConfigError
from transfer.cuda_driver import IpcHandle
from transfer.cuda_ipc import CopyPath, CudaIpcBackend, kernel_available
from transfer.cuda_peer import PeerPool, PoolExport
from transfer.factory import make_backend
from transfer.manager import KVTransferManager
from transfer.room import RoomState

HAS_GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs CUDA")

PAGE = 4096
NUM_PAGES = 32
OFFSET = 3 * PAGE  # the child's pool starts this far inside its allocation


def _export(**changes: object) -> PoolExport:
    e = PoolExport(
        boot_id=b"b" * 16,
        pid=1234,
        process_token=b"t" * 8,
        device_uuid=b"u" * 16,
        ipc_handle=b"h" * 64,
        ptr=0x7F00_0000_1000,
        nbytes=1 << 20,
        offset=0x1000,
    )
    return replace(e, **changes)  # type: ignore[arg-type]


# ---- everywhere -------------------------------------------------------------------------------


def test_config_selects_cuda_ipc_and_refuses_checksum() -> None:
    TransferConfig(backend="cuda_ipc").validate()
    with pytest.raises(
        TransferConfigError, match=r"transfer.checksum .*cuda_ipc.*set transfer.checksum: false"
    ):
        TransferConfig(backend="cuda_ipc", checksum=True).validate()
    with pytest.raises(
        TransferConfigError, match=r"transfer.backend must be one of mooncake \| nixl \| cuda_ipc"
    ):
        TransferConfig(backend="ipc").validate()  # type: ignore[arg-type]
    cluster = load_config(REPO / "configs" / "tiny-1p1d.yaml", ["transfer.backend=cuda_ipc"])
    assert cluster.transfer.backend == "cuda_ipc"
    with pytest.raises(ClusterConfigError, match=r"transfer.checksum"):
        load_config(
            REPO / "configs" / "tiny-1p1d.yaml",
            ["transfer.backend=cuda_ipc", "transfer.checksum=true"],
        )


def test_missing_driver_is_refused_naming_the_fix() -> None:
    with pytest.raises(
        TransferConfigError,
        match=r"transfer.backend is cuda_ipc but the CUDA driver .* cannot be "
        r"loaded.*use transfer.backend mooncake or nixl",
    ):
        CudaIpcBackend("x", libcuda="libcuda-not-here.so.0")


@pytest.mark.skipif(HAS_GPU, reason="checks a host without CUDA")
def test_no_cuda_here_is_refused_at_start() -> None:
    with pytest.raises(
        TransferConfigError, match=r"transfer.backend is cuda_ipc.*mooncake or nixl"
    ):
        make_backend(TransferConfig(backend="cuda_ipc"), "127.0.0.1", "tandem-decode-x")


def test_metadata_round_trip_and_refusals() -> None:
    e = _export()
    assert PoolExport.unpack("peer", e.pack()) == e
    handle = (
        bytes([0, 1, 0, 2]) * 16
    )  # real handles hold NUL bytes: none may be lost on the way to the driver
    assert bytes(IpcHandle.of(handle)) == handle
    with pytest.raises(BackendError, match=r"metadata of peer 'peer' is 10 bytes, expected"):
        PoolExport.unpack("peer", e.pack()[:10])
    with pytest.raises(BackendError, match=r"not cuda_ipc version 1"):
        PoolExport.unpack("peer", b"X" + e.pack()[1:])
    with pytest.raises(BackendError, match=r"inconsistent"):
        PoolExport.unpack("peer", _export(offset=1 << 62).pack())


def test_peer_addresses_translate_inside_the_pool_only() -> None:
    pool = PeerPool("d", ptr=0x1000, nbytes=0x100, local_ptr=0x9000, opened=0x8000)
    assert pool.translate(0x1000, 0x100) == 0x9000
    assert pool.translate(0x1080, 0x10) == 0x9080
    for dst, n in ((0x0FFF, 2), (0x10F0, 0x11), (0x1000, 0)):
        with pytest.raises(BackendError, match=r"outside the pool peer 'd' registered"):
            pool.translate(dst, n)


# ---- GPU: a decode pool in another process ----------------------------------------------------


def _serve_pool(cmds: mp.Queue, out: mp.Queue) -> None:
    """Child: a zeroed pool OFFSET bytes into a larger allocation, exported; dumps it on request."""
    alloc = torch.zeros(OFFSET + NUM_PAGES * PAGE + PAGE, dtype=torch.uint8, device="cuda")
    pool = alloc[OFFSET : OFFSET + NUM_PAGES * PAGE]
    backend = CudaIpcBackend("decode-child")
    backend.register(pool.data_ptr(), pool.numel())
    out.put((backend.agent_name, backend.agent_metadata, pool.data_ptr()))
    try:
        while (cmd := cmds.get(timeout=120)) != "stop":
            if cmd == "dump":
                torch.cuda.synchronize()
                out.put(bytes(pool.cpu().numpy()))
            elif cmd == "zero":
                pool.zero_()
                torch.cuda.synchronize()
                out.put("ok")
    finally:
        backend.close()


@dataclass
class Child:
    name: str
    meta: bytes
    ptr: int
    cmds: mp.Queue
    out: mp.Queue

    def dump(self) -> bytes:
        self.cmds.put("dump")
        return bytes(self.out.get(timeout=30))

    def zero(self) -> None:
        self.cmds.put("zero")
        assert self.out.get(timeout=30) == "ok"


@pytest.fixture(scope="module")
def child() -> Iterator[Child]:
    ctx = mp.get_context("spawn")
    cmds, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_serve_pool, args=(cmds, out), daemon=True)
    proc.start()
    try:
        name, meta, ptr = out.get(timeout=120)
        yield Child(name, meta, ptr, cmds, out)
        cmds.put("stop")
    finally:
        proc.join(20)
        if proc.is_alive():
            proc.kill()


PATHS = [CopyPath.MEMCPY] + ([CopyPath.KERNEL] if kernel_available() else [])


@pytest.fixture(params=PATHS, ids=[p.value for p in PATHS])
def prefill(request: pytest.FixtureRequest) -> Iterator[tuple[CudaIpcBackend, torch.Tensor]]:
    """The writing side, once per copy path: the gather kernel, and the per-span reference."""
    src = torch.randint(
        0, 256, (NUM_PAGES * PAGE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    ).cuda()
    backend = CudaIpcBackend("prefill-test", copy_path=request.param)
    backend.register(src.data_ptr(), src.numel())
    yield backend, src
    backend.close()


def _spans(
    src: torch.Tensor, child: Child, pairs: list[tuple[int, int]]
) -> list[tuple[int, int, int]]:
    return [(src.data_ptr() + s * PAGE, child.ptr + d * PAGE, PAGE) for s, d in pairs]


def _page(blob: bytes, i: int) -> bytes:
    return blob[i * PAGE : (i + 1) * PAGE]


@pytest.mark.gpu
@gpu
def test_host_memory_is_refused_as_the_pool() -> None:
    host = torch.zeros(PAGE, dtype=torch.uint8)
    backend = CudaIpcBackend("host")
    try:
        with pytest.raises(
            TransferConfigError,
            match=r"the KV pool at 0x[0-9a-f]+ is host memory.*parallel.device: cuda",
        ):
            backend.register(host.data_ptr(), PAGE)
        with pytest.raises(BackendError, match=r"no KV pool registered"):
            _ = backend.agent_metadata
    finally:
        backend.close()


@pytest.mark.gpu
@gpu
def test_pages_land_bit_exact_in_another_process(
    child: Child, prefill: tuple[CudaIpcBackend, torch.Tensor]
) -> None:
    backend, src = prefill
    child.zero()
    backend.connect(child.name, child.meta)
    backend.connect(child.name, child.meta)  # idempotent
    pairs = [(3, 0), (4, 17), (9, 31), (10, 5), (0, 6)]
    backend.write(child.name, _spans(src, child, pairs), timeout_s=10)
    landed, source = child.dump(), bytes(src.cpu().numpy())
    for s, d in pairs:
        assert _page(landed, d) == _page(source, s), (s, d)
    untouched = set(range(NUM_PAGES)) - {d for _, d in pairs}
    assert all(_page(landed, d) == bytes(PAGE) for d in untouched), (
        "only the spans' pages are written"
    )
    with pytest.raises(BackendError, match=r"outside the pool peer"):
        backend.submit(child.name, [(src.data_ptr(), child.ptr + NUM_PAGES * PAGE, PAGE)])
    with pytest.raises(BackendError, match=r"source range .* outside every registered region"):
        backend.submit(child.name, [(src.data_ptr() + NUM_PAGES * PAGE, child.ptr, PAGE)])


@pytest.mark.gpu
@gpu
def test_copy_waits_for_kernels_still_running(
    child: Child, prefill: tuple[CudaIpcBackend, torch.Tensor]
) -> None:
    """The forward that writes a page may still run when its pages are handed over: the copy
    must start after it. A long kernel, then a fill, both on the default stream, then the write
    from another thread (as the manager's transfer thread does) with no host sync between."""
    backend, src = prefill
    child.zero()
    backend.connect(child.name, child.meta)
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s of spinning on the default stream
    src.fill_(0x5A)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            backend.write(
                child.name, _spans(src, child, [(i, i) for i in range(NUM_PAGES)]), timeout_s=10
            )
        except BaseException as e:  # handed to the test thread
            errors.append(e)

    t = threading.Thread(target=write)
    t.start()
    t.join(30)
    assert not errors, errors
    assert child.dump() == b"\x5a" * (NUM_PAGES * PAGE)


@pytest.mark.gpu
@gpu
def test_forget_then_reconnect(child: Child, prefill: tuple[CudaIpcBackend, torch.Tensor]) -> None:
    backend, src = prefill
    child.zero()
    backend.connect(child.name, child.meta)
    backend.forget(child.name)
    backend.forget(child.name)  # idempotent
    with pytest.raises(BackendError, match=r"peer 'decode-child' is not connected"):
        backend.submit(child.name, _spans(src, child, [(1, 1)]))
    backend.connect(child.name, child.meta)
    backend.write(child.name, _spans(src, child, [(1, 2)]), timeout_s=10)
    assert _page(child.dump(), 2) == _page(bytes(src.cpu().numpy()), 1)


@pytest.mark.gpu
@gpu
def test_bad_or_foreign_metadata_is_refused(
    child: Child, prefill: tuple[CudaIpcBackend, torch.Tensor]
) -> None:
    backend, _ = prefill
    theirs = PoolExport.unpack(child.name, child.meta)
    with pytest.raises(BackendError, match=r"cuIpcOpenMemHandle \(peer 'bad'.*failed: CUDA_ERROR"):
        backend.connect("bad", replace(theirs, ipc_handle=bytes(64)).pack())
    with pytest.raises(BackendError, match=r"peer 'far' runs on another host.*mooncake or nixl"):
        backend.connect("far", replace(theirs, boot_id=bytes(16)).pack())
    with pytest.raises(BackendError, match=r"peer 'gpu' uses a GPU this process cannot see"):
        backend.connect("gpu", replace(theirs, device_uuid=b"\xff" * 16).pack())
    with pytest.raises(BackendError, match=r"expected"):
        backend.connect("short", child.meta[:-1])
    with pytest.raises(BackendError, match=r"peer 'bad' is not connected"):
        backend.submit("bad", [])


@pytest.mark.gpu
@gpu
def test_both_roles_in_one_process() -> None:
    """A process cannot open its own IPC handle: a peer that is this process is written directly."""
    a_pool = torch.arange(NUM_PAGES * PAGE, device="cuda").to(torch.uint8)
    b_pool = torch.zeros(NUM_PAGES * PAGE, dtype=torch.uint8, device="cuda")
    a, b = CudaIpcBackend("a"), CudaIpcBackend("b")
    try:
        a.register(a_pool.data_ptr(), a_pool.numel())
        b.register(b_pool.data_ptr(), b_pool.numel())
        a.connect(b.agent_name, b.agent_metadata)
        a.write(
            b.agent_name,
            [(a_pool.data_ptr() + PAGE, b_pool.data_ptr() + 7 * PAGE, 2 * PAGE)],
            timeout_s=10,
        )
        assert torch.equal(b_pool[7 * PAGE : 9 * PAGE], a_pool[PAGE : 3 * PAGE])
        assert int(b_pool[: 7 * PAGE].count_nonzero()) == 0
    finally:
        a.close()
        b.close()


# ---- GPU: whole rooms between two managers in two processes -------------------------------------

SEED = 11
CONFIG = TransferConfig(backend="cuda_ipc", transfer_timeout_s=10)


def _seeded_pool(nbytes: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(SEED)
    ).cuda()


def _serve_prefill(cmds: mp.Queue, out: mp.Queue) -> None:
    """Child: a prefill manager over a seeded GPU pool; ("room", id, src_pages, corrupt) sends
    them."""
    lay = layout(num_pages=16)
    pool = _seeded_pool(lay.pool_bytes)
    mgr = KVTransferManager(
        CONFIG,
        lay,
        role="prefill",
        kv_ptr=pool.data_ptr(),
        kv_nbytes=pool.numel(),
        host="127.0.0.1",
        model_fingerprint="fp",
        model_name="tiny",
        faults=TransferFaults(),
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    mgr.add_to_server(server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    out.put(addr)
    try:
        while (cmd := cmds.get(timeout=120))[0] != "stop":
            _, room, src_pages, corrupt = cmd
            mgr.faults = TransferFaults(corrupt=1.0 if corrupt else 0.0)
            sender = mgr.create_sender(room)
            sender.send(src_pages, start_page=0, last=True, first_token=5, first_logprob=-0.5)
            wait_finished([sender], timeout_s=30)
            out.put((sender.state.name, sender.error, sender.stats.bytes))
            mgr.take_finished()
    finally:
        server.stop(None)
        mgr.close()


@pytest.mark.gpu
@gpu
def test_rooms_between_two_managers_in_two_processes() -> None:
    ctx = mp.get_context("spawn")
    cmds, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_serve_prefill, args=(cmds, out), daemon=True)
    proc.start()
    lay = layout(num_pages=16)
    pool = torch.zeros(lay.pool_bytes, dtype=torch.uint8, device="cuda")
    decode = KVTransferManager(
        CONFIG,
        lay,
        role="decode",
        kv_ptr=pool.data_ptr(),
        kv_nbytes=pool.numel(),
        host="127.0.0.1",
        model_fingerprint="fp",
        model_name="tiny",
        peer_id="decode-0",
        faults=TransferFaults(),
    )
    source = _seeded_pool(lay.pool_bytes)
    pb = lay.page_bytes
    try:
        addr = out.get(timeout=120)
        src, dst = [3, 9, 4, 12], [1, 2, 0, 15, 7]
        recv = decode.create_receiver(0xC0DA, addr, dst, num_tokens=15)
        cmds.put(("room", 0xC0DA, src, False))
        wait_finished([recv], timeout_s=30)
        assert recv.state is RoomState.SUCCESS, recv.error
        assert (recv.first_token, recv.stats.bytes) == (5, 4 * pb)
        assert out.get(timeout=10) == ("SUCCESS", None, 4 * pb)
        for s, d in zip(src, dst, strict=False):
            assert torch.equal(pool[d * pb : (d + 1) * pb], source[s * pb : (s + 1) * pb]), (s, d)
        assert int(pool[7 * pb : 8 * pb].count_nonzero()) == 0, (
            "the first token's page is not written"
        )

        # the corrupt drill really overwrites landed pages, from pinned host memory into the
        # peer's GPU
        recv2 = decode.create_receiver(0xBAD, addr, [10], num_tokens=4)
        cmds.put(("room", 0xBAD, [6], True))
        wait_finished([recv2], timeout_s=30)
        assert recv2.state is RoomState.SUCCESS, "without a checksum only the bytes tell"
        assert out.get(timeout=10)[0] == "SUCCESS"
        assert not torch.equal(pool[10 * pb : 11 * pb], source[6 * pb : 7 * pb])
        assert {r.room for r in decode.take_finished()} == {0xC0DA, 0xBAD}
        cmds.put(("stop",))
    finally:
        proc.join(20)
        if proc.is_alive():
            proc.kill()
        decode.close()


def test_module_imports_no_torch() -> None:
    """transfer/ stays torch-free: the backend speaks to the driver directly."""
    code = "import sys, transfer.cuda_ipc; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, check=False).returncode == 0
