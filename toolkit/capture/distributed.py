"""Several processes and several GPUs: the ranks of a torchrun job, and one model over several GPUs.

Data parallelism over samples (capture) and prompts (eval). ``torchrun --nproc-per-node N -m
sparsecal.cli capture ...`` starts N copies of the command; ``start`` joins them into one process
group from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK; gloo for the few small control
messages, with NCCL beside it on a CUDA machine) and returns this process's ``Ranks``. Rank 0 does
every check and owns the output directory's manifest (``Ranks.lead``): it creates or resumes the
run, plans it and hands every rank the same list of unfinished samples; each rank takes its
deterministic ``share`` of that list, runs on ``cuda:LOCAL_RANK`` (``Ranks.device``) and writes
each finished sample atomically into the one directory. Nothing is shared in memory: the run
store's file lock and atomic renames are the only coordination on disk, so the ranks may sit on
several hosts with the directory on a shared filesystem. ``Ranks.gather`` brings the ranks'
results to rank 0 for the summary. A rank that dies loses only the sample it was working on (and
torchrun stops the others, which lose theirs); the same command on any number of ranks captures
exactly what is missing. ``launch`` is ``--gpus N``: the command starts its N ranks on this host
itself, as torchrun would (the same RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT
environment, so a rank cannot tell them apart), but without importing torch first: the launcher's
checks (``parse_device``, ``cuda_count``) and ``spawn`` are plain Python and ctypes, so the ranks
start ~0.1 s after the command instead of after a torch and torchrun import (4.7 s measured on two
H100s). A failing rank is reported in one line and the others are stopped; the ranks end when
this process ends, however it ends (a parent-death signal: formats/children.py).

Placement (``--device-map auto``): accelerate spreads one model's layers over the GPUs, and the
CPU where ``--max-memory`` (``parse_max_memory``) says so; ``check_placement`` refuses what cannot
work, ``follow_layer_devices`` makes the current CUDA device follow the layer being run (Triton
launches its kernels on the current device, not on the device of their tensors), ``placement``
describes where the layers went and ``peak_memory`` reports the peak allocated memory per GPU.
"""
from __future__ import annotations

import datetime
import os
import re
import signal
import sys
from dataclasses import dataclass

from sparsecal.formats.errors import UserError

# Ranks wait for each other at the start (rank 0's checks and plan) and at the end (the slowest
# rank's share): far longer than torch's 30-minute default may pass at 128K tokens on a 70B model.
TIMEOUT = datetime.timedelta(hours=24)
SIZE = re.compile(r"^\d+(\.\d+)?\s*(gib|gb|mib|mb|kib|kb)$", re.IGNORECASE)
GIB = 1024 ** 3
# torch.device's device types (torch 2.x): what parse_device accepts, without importing torch
DEVICE_TYPES = ("cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga", "maia",
                "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone")
DEVICE = re.compile(r"^([a-z]+)(?::(0|[1-9]\d*))?$")
STOP_GRACE_S = 10.0  # a rank told to stop (SIGTERM) is killed after this long


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job: rank (0 leads), world size, rank on its host."""

    rank: int = 0
    world: int = 1
    local: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def several(self) -> bool:
        return self.world > 1

    @property
    def tag(self) -> str:
        """The prefix of this rank's progress lines ('' for one process)."""
        return f"\\[rank {self.rank}/{self.world}] " if self.several else ""  # rich markup, escaped

    def device(self, device: str) -> str:
        """This rank's torch device for ``--device``: with several ranks, ``cuda`` is
        ``cuda:LOCAL_RANK``. A CUDA device is also made the current one (where Triton launches)."""
        import torch

        dev = torch.device(device)
        if dev.type != "cuda":
            return device
        if self.several:
            if dev.index is not None:
                raise UserError(f"--device {device}: with several ranks give --device cuda; rank r uses "
                                "cuda:LOCAL_RANK of its host.")
            count = torch.cuda.device_count()
            if self.local >= count:
                raise UserError(f"rank {self.rank} is local rank {self.local} but its host has {count} GPU(s); start "
                                "at most one rank per GPU (--nproc-per-node).")
            dev = torch.device("cuda", self.local)
        if dev.index is not None:  # plain "cuda" (one process) is the current device already
            torch.cuda.set_device(dev)
        return str(dev)

    def lead(self, fn):
        """Rank 0 runs ``fn()`` (the checks, the output directory's manifest) while the other ranks
        wait; every rank returns rank 0's result. When rank 0 fails (bad input: it prints the one
        error line) the others exit silently with its exit code."""
        if not self.several:
            return fn()
        import torch.distributed as dist

        box = [None]
        if not self.main:
            dist.broadcast_object_list(box, src=0)
            status, value = box[0]
            if status != "ok":
                raise SystemExit(value)
            return value
        try:
            value = fn()
        except BaseException as e:
            box[0] = ("stop", UserError.exit_code if isinstance(e, UserError) else 1)
            dist.broadcast_object_list(box, src=0)
            raise
        box[0] = ("ok", value)
        dist.broadcast_object_list(box, src=0)
        return value

    def share(self, items: list, weight) -> list:
        """This rank's part of ``items`` (the same list on every rank); see ``share``."""
        return share(items, self.world, self.rank, weight)

    def gather(self, value) -> list:
        """Every rank's ``value`` in rank order, on every rank (waits for the slowest rank)."""
        if not self.several:
            return [value]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, value)
        return out


def share(items: list, world: int, rank: int, weight) -> list:
    """Rank ``rank``'s deterministic part of ``items``: longest first (``weight``, e.g. tokens), each
    item goes to the least loaded rank so far (ties: the lowest rank); each part keeps the list's
    order. Equal weights deal the items out in turn."""
    loads = [0.0] * world
    owner = {}
    for i in sorted(range(len(items)), key=lambda i: (-weight(items[i]), i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        loads[r] += weight(items[i])
        owner[i] = r
    return [x for i, x in enumerate(items) if owner[i] == rank]


def from_env(environ=None) -> Ranks:
    """The ranks torchrun describes in RANK, WORLD_SIZE and LOCAL_RANK (one process without them)."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env:
        return Ranks()
    try:
        world, rank, local = int(env["WORLD_SIZE"]), int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0"))
    except ValueError:
        raise UserError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (torchrun sets them).") from None
    if not (world >= 1 and 0 <= rank < world and local >= 0):
        raise UserError(f"RANK {rank} and WORLD_SIZE {world} do not describe a rank (torchrun sets them).")
    return Ranks(rank, world, local)


def start() -> Ranks:
    """This process's ranks; under torchrun with several ranks, joins their process group (gloo;
    on a CUDA machine 'cpu:gloo,cuda:nccl', whose NCCL side starts only if a CUDA tensor is sent)."""
    ranks = from_env()
    if ranks.several:
        import atexit

        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, timeout=TIMEOUT)
            atexit.register(close)
    return ranks


def close() -> None:
    """Destroy this process's process group, if any (call it once every rank is done; atexit
    calls it too for a command that stops early)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# ---- --gpus N: the ranks started by the command itself ---------------------------------------
def parse_device(text: str) -> tuple[str, int | None]:
    """'cuda:1' -> ('cuda', 1), 'cpu' -> ('cpu', None): what torch.device accepts, without torch.
    ValueError for anything else."""
    found = DEVICE.match(text)
    if not found or found.group(1) not in DEVICE_TYPES:
        raise ValueError(f"not a torch device: {text!r}")
    return found.group(1), None if found.group(2) is None else int(found.group(2))


def cuda_count() -> int:
    """The CUDA devices this process can use (CUDA_VISIBLE_DEVICES honoured). Once torch is imported
    its own answer; before (the ``--gpus`` launcher) the driver's (libcuda's cuDeviceGetCount through
    ctypes: ~0.1 s, no torch); 0 without a driver."""
    if "torch" in sys.modules:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0  # no device (CUDA_VISIBLE_DEVICES="", a driver without GPUs)
    return count.value


def launch(n: int, args: list[str], device: str) -> int:
    """Run ``python -m sparsecal.cli ARGS`` on ``n`` ranks of this host; returns the exit code. A
    rank's bad-input line is the one line printed; any other failure is named. Nothing here imports
    torch: the ranks start at once, and import it side by side."""
    check_gpus(n, device)
    return spawn(n, [sys.executable, "-m", "sparsecal.cli", *args])


def check_gpus(n: int, device: str) -> None:
    """Refuse a --gpus N that cannot start here (before anything else is checked or started)."""
    if n < 2:
        return
    if from_env().several:
        raise UserError("--gpus starts the ranks itself: under torchrun, leave it out.")
    try:
        kind, index = parse_device(device)
    except ValueError:
        return  # check_dtype_device names the bad device
    if kind == "cuda":
        if index is not None:
            raise UserError(f"--gpus {n} --device {device}: give --device cuda; rank r uses cuda:r.")
        have = cuda_count()
        if n > have:
            raise UserError(f"--gpus {n}: only {have} CUDA device(s) here.")


def rank_env(n: int, rank: int, port: int, base: dict | None = None) -> dict:
    """Rank ``rank``'s environment: torchrun's variables (one host, rendezvous on ``port`` of
    127.0.0.1), one parent it dies with (formats/children.py), and the thread and cache defaults
    the ranks share (``shared_defaults``)."""
    from sparsecal.formats.children import launcher_env

    env = launcher_env(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), GROUP_RANK="0",
               ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for key, value in shared_defaults(n).items():
        env.setdefault(key, value)
    return env


def shared_defaults(n: int) -> dict:
    """OMP_NUM_THREADS: this host's cores shared out over the ranks. TRITON_CACHE_DIR: Triton's own
    default (~/.triton/cache) made explicit, so that every rank, and every later run of this user,
    reads the kernels one of them compiled: a cache under the run directory would be cold for each
    new --out, and one per rank would compile everything N times. Triton writes each entry to a
    temporary file and renames it into place, so ranks that compile the same kernel at once are
    safe. A value the user set is kept (``rank_env``)."""
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n)),
            "TRITON_CACHE_DIR": os.path.join(home, ".triton", "cache")}


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (rank 0 binds it for the process group's store)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(n: int, cmd: list[str]) -> int:
    """Start ``cmd`` as ranks 0..n-1 (each in its own session, as torchrun does: a Ctrl-C reaches
    this process, which stops them) and wait. The first rank to fail stops the others (SIGTERM,
    SIGKILL after STOP_GRACE_S); the job's exit code (``_failure``). Ctrl-C or SIGTERM here stops
    the ranks and becomes KeyboardInterrupt (the CLI's resume hint, exit code 130)."""
    import subprocess

    port = free_port()
    procs = {}
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for r in range(n):
            procs[r] = subprocess.Popen(cmd, env=rank_env(n, r, port), start_new_session=True)
        failures = _wait_ranks(procs)
    except KeyboardInterrupt:
        _stop(procs)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    return _failure(failures) if failures else 0


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _wait_ranks(procs: dict) -> dict:
    """Wait for every rank; at the first that fails, stop the others. {rank: exit code (-signal)} of
    the ranks that failed, in the order they ended."""
    by_pid = {p.pid: r for r, p in procs.items()}
    failures: dict = {}
    while by_pid:
        pid, status = os.waitpid(-1, 0)
        if pid not in by_pid:
            continue
        rank = by_pid.pop(pid)
        procs[rank].returncode = code = os.waitstatus_to_exitcode(status)
        if code != 0:
            failures[rank] = code
            if len(failures) == 1:
                _stop_later({r: procs[r] for r in by_pid.values()})
    return failures


def _stop_later(procs: dict) -> None:
    """SIGTERM to each rank still running; SIGKILL from a timer to any left after STOP_GRACE_S."""
    import threading

    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    timer = threading.Timer(STOP_GRACE_S, lambda: [p.kill() for p in procs.values() if p.returncode is None])
    timer.daemon = True
    timer.start()


def _stop(procs: dict) -> None:
    """SIGTERM to each rank still running, SIGKILL to any left after STOP_GRACE_S."""
    import subprocess

    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    for p in procs.values():
        try:
            p.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _failure(failures: dict) -> int:
    """The exit code of a failed job, and one line unless a rank already printed it."""
    # the rank that failed first; the lowest rank among those that ended the same way (rank 0's
    # crash ends the others with its exit code, and one of them may be reaped first)
    first = next(iter(failures.values()))
    rank, code = min(r for r, c in failures.items() if c == first), first
    if code == UserError.exit_code:
        return code  # bad input: the rank printed its one error line
    what = f"exit code {code}" if code > 0 else f"signal {-code}"
    print(f"error: rank {rank} stopped ({what}); finished work is kept: run the same command to resume.",
          file=sys.stderr)
    return code if code > 0 else 1


# ---- --device-map auto: one model over several GPUs ------------------------------------------
def parse_max_memory(text: str) -> dict:
    """'0=20GiB,1=20GiB,cpu=64GiB' -> {0: '20GiB', 1: '20GiB', 'cpu': '64GiB'} (accelerate's form)."""
    out: dict = {}
    for item in (x.strip() for x in text.split(",")):
        key, eq, size = (s.strip() for s in item.partition("="))
        if not (eq and (key.isdigit() or key == "cpu") and SIZE.match(size)):
            raise UserError(f"--max-memory '{text}': each item is GPU=SIZE or cpu=SIZE with SIZE in GiB, GB, MiB "
                            "or MB (e.g. 0=20GiB,1=20GiB,cpu=64GiB).")
        key = int(key) if key.isdigit() else key
        if key in out:
            raise UserError(f"--max-memory '{text}' names {key} twice.")
        out[key] = size.replace(" ", "")
    return out


def check_placement(device_map: str | None, max_memory: str | None, device: str, gpus: int = 1) -> dict | None:
    """Refuse a placement that cannot work, in one line; the parsed --max-memory (None: none)."""
    if device_map is None:
        if max_memory is not None:
            raise UserError("--max-memory sets the budgets of --device-map auto: add --device-map auto.")
        return None
    if device_map != "auto":
        raise UserError(f"--device-map '{device_map}': only 'auto' (accelerate's placement over the GPUs) is "
                        "supported.")
    if gpus > 1 or from_env().several:
        raise UserError("--device-map spreads one model over the GPUs of one process; it does not combine with "
                        "--gpus or several torchrun ranks: use one or the other.")
    try:
        kind, index = parse_device(device)
    except ValueError:
        raise UserError(f"--device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1).") from None
    if index is not None:
        raise UserError(f"--device-map auto places the layers itself: give --device {kind}, not {device} "
                        "(limit the GPUs with --max-memory or CUDA_VISIBLE_DEVICES).")
    memory = parse_max_memory(max_memory) if max_memory is not None else None
    for key in memory or {}:
        have = cuda_count() if kind == "cuda" else 0
        if key != "cpu" and key >= have:
            raise UserError(f"--max-memory names GPU {key}, but --device {device} uses {have} GPU(s) here.")
    return memory


def follow_layer_devices(model) -> None:
    """Make the current CUDA device follow the module being run: every module accelerate placed on
    a GPU sets it before its forward (Triton launches on the current device)."""
    import torch

    for module in model.modules():
        dev = _execution_device(getattr(module, "_hf_hook", None))
        if dev is not None and dev.type == "cuda":
            module.register_forward_pre_hook(lambda _m, _args, dev=dev: torch.cuda.set_device(dev))


def _execution_device(hook):
    import torch

    for h in getattr(hook, "hooks", None) or [hook]:  # accelerate's SequentialHook holds several
        dev = getattr(h, "execution_device", None)
        if dev is not None:
            return torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev)
    return None


def placement(model) -> str:
    """Where accelerate put the model: 'cuda:0 layers 0-13 (+3 modules); cuda:1 layers 14-31 (+2)'."""
    where: dict = {}
    for name, dev in (getattr(model, "hf_device_map", None) or {}).items():
        dev = f"cuda:{dev}" if isinstance(dev, int) else str(dev)
        found = re.search(r"layers\.(\d+)$", name)
        layers, others = where.setdefault(dev, ([], []))
        (layers if found else others).append(int(found.group(1)) if found else name)
    parts = []
    for dev, (layers, others) in where.items():
        text = f"layers {_ranges(layers)}" if layers else ""
        text += (" + " if layers and others else "") + (f"{len(others)} other modules" if others else "")
        parts.append(f"{dev} {text}")
    return "; ".join(parts) or str(next(model.parameters()).device)


def _ranges(ids: list[int]) -> str:
    ids, out = sorted(ids), []
    for i in ids:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def peak_memory(model, device: str) -> dict[str, int]:
    """{'cuda:i': peak bytes allocated} of every GPU the model or ``device`` is on (none on a CPU)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    devs = {p.device for p in model.parameters()} | {torch.device(device)}
    index = sorted({torch.cuda.current_device() if d.index is None else d.index for d in devs if d.type == "cuda"})
    return {f"cuda:{i}": int(torch.cuda.max_memory_allocated(i)) for i in index}


def memory_line(peaks: list[dict]) -> str:
    """'peak GPU memory: cuda:0 12.3 GiB, cuda:1 12.1 GiB' over the ranks' ``peak_memory`` (rank-tagged
    with several ranks); '' when no GPU ran."""
    many = len(peaks) > 1
    items = [f"{f'rank {r} ' if many else ''}{dev} {b / GIB:.2f} GiB"
             for r, p in enumerate(peaks) for dev, b in p.items()]
    return f"peak GPU memory: {', '.join(items)}" if items else ""
