"""Pre-flight checks for a node of an mcore_rl cluster.

    python -m mcore_rl.preflight.doctor [--json]

Every check yields findings with a severity (ok / warn / error), a detail and a fix line. The
exit code is 1 only when some finding is an error, i.e. a real blocker; a CPU-only machine
(no NVIDIA driver) gets warnings, not errors. Checks read the environment and the host through a
`Context`, so tests can run them against a given environment.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

OK, WARN, ERROR = "ok", "warn", "error"
GiB = 1 << 30


@dataclass
class Finding:
    check: str
    severity: str
    detail: str
    fix: str = ""


@dataclass
class Context:
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    interfaces: dict[str, list[str]] | None = None  # up interface -> IPv4 addresses; None: this host
    ib_root: str = "/sys/class/infiniband"
    shm_path: str = "/dev/shm"
    gpus: list[dict] | None = None  # filled by check_gpus; None: no usable NVML

    def nics(self) -> dict[str, list[str]]:
        if self.interfaces is None:
            import psutil

            stats = psutil.net_if_stats()
            self.interfaces = {
                name: [a.address for a in addrs if a.family == socket.AF_INET]
                for name, addrs in psutil.net_if_addrs().items()
                if name in stats and stats[name].isup
            }
        return self.interfaces


# --------------------------------------------------------------------------- versions
# (distribution, required, specifier used when mcore_rl's own metadata is unavailable, install hint)
PACKAGES = [
    ("torch", True, ">=2.6", "pip install torch (CPU: --index-url https://download.pytorch.org/whl/cpu)"),
    ("megatron-core", True, "==0.16.1", "pip install megatron-core==0.16.1 (mcore_rl's patches target it)"),
    ("transformers", True, ">=5.0", "pip install 'transformers>=5'"),
    ("ray", True, ">=2.40", "pip install 'ray[default]>=2.40'"),
    ("nvidia-ml-py", True, ">=12.0", "pip install nvidia-ml-py"),
    ("psutil", True, ">=5.9", "pip install psutil (megatron dist_checkpointing hangs without it)"),
    ("transformer-engine", False, "", "optional, GPU nodes: pip install 'mcore_rl[te]' --no-build-isolation"),
    ("sglang", False, "==0.5.23", "optional, rollout nodes: pip install 'mcore_rl[sglang]'"),
    ("torch_memory_saver", False, ">=0.0.10", "optional, GPU nodes: pip install 'mcore_rl[gpu]'"),
]
MIN_PIP = "23.0"


def _declared_specifiers() -> dict[str, str]:
    """Specifiers from mcore_rl's installed metadata (pyproject.toml), extras included."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        reqs = metadata.requires("mcore_rl") or []
    except metadata.PackageNotFoundError:
        return {}
    return {canonicalize_name(r.name): str(r.specifier) for r in map(Requirement, reqs)}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check_python(ctx: Context) -> list[Finding]:
    v = platform.python_version()
    if sys.version_info < (3, 11):
        return [Finding("python", ERROR, f"Python {v}; mcore_rl needs >= 3.11", "use Python 3.11 or 3.12")]
    return [Finding("python", OK, f"Python {v} ({sys.executable})")]


def check_packages(ctx: Context) -> list[Finding]:
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    declared = _declared_specifiers()
    out = []
    for dist, required, fallback, hint in PACKAGES:
        spec = declared.get(canonicalize_name(dist), fallback)
        name = f"pkg:{dist}"
        have = _version(dist)
        if have is None:
            sev = ERROR if required else WARN
            out.append(Finding(name, sev, "not installed" + ("" if required else " (optional)"), hint))
        elif spec and not SpecifierSet(spec).contains(Version(have), prereleases=True):
            out.append(Finding(name, ERROR, f"{have} does not satisfy {spec}", f"pip install '{dist}{spec}'"))
        else:
            out.append(Finding(name, OK, have + (f" (wants {spec})" if spec else "")))
    return out


def check_pip(ctx: Context) -> list[Finding]:
    from packaging.version import Version

    have = _version("pip")
    if have is None:
        return [Finding("pip", WARN, "pip not installed in this environment", f"{sys.executable} -m ensurepip")]
    if Version(have) < Version(MIN_PIP):
        return [Finding("pip", WARN, f"pip {have} is old (< {MIN_PIP}): torch wheel variants and editable "
                        "pyproject installs resolve wrongly", f"{sys.executable} -m pip install -U pip")]
    return [Finding("pip", OK, f"pip {have}")]


# --------------------------------------------------------------------------- GPUs
def check_gpus(ctx: Context) -> list[Finding]:
    try:
        import pynvml
    except ImportError:
        return [Finding("gpu", WARN, "nvidia-ml-py missing: cannot query GPUs", "pip install nvidia-ml-py")]
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded) as e:
        return [Finding("gpu", WARN, f"no NVIDIA GPU usable ({type(e).__name__}): CPU-only machine",
                        "fine for CPU tests; on a GPU node install the driver / run the container with GPUs")]
    except pynvml.NVMLError as e:
        return [Finding("gpu", ERROR, f"NVML init failed: {e}", "check the NVIDIA driver: nvidia-smi")]
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append({"index": i, "name": pynvml.nvmlDeviceGetName(h), "uuid": pynvml.nvmlDeviceGetUUID(h),
                         "total": mem.total, "used": mem.used})
    finally:
        pynvml.nvmlShutdown()
    ctx.gpus = gpus
    if not gpus:
        return [Finding("gpu", WARN, f"driver {driver} but no GPU", "check the node's GPU allocation")]
    out = [Finding("gpu", OK, f"{len(gpus)} x {gpus[0]['name']} ({gpus[0]['total'] / GiB:.0f} GiB), driver {driver}")]
    busy = [f"{g['index']} ({g['used'] / GiB:.1f} GiB)" for g in gpus if g["used"] > 0.1 * g["total"]]
    if busy:
        out.append(Finding("gpu_memory", WARN, f"memory already in use on GPU {', '.join(busy)}",
                           "find the owner with nvidia-smi; stale Ray workers: scripts/jobs.sh list / stop"))
    try:
        import torch

        if torch.version.cuda is None:
            out.append(Finding("torch_cuda", ERROR, f"torch {torch.__version__} is a CPU build on a GPU node",
                               "install a CUDA build of torch (docker/Dockerfile.gpu)"))
    except ImportError:
        pass
    return out


def check_visible_devices(ctx: Context) -> list[Finding]:
    raw = ctx.env.get("CUDA_VISIBLE_DEVICES")
    name = "cuda_visible_devices"
    if raw is None:
        return [Finding(name, OK, "unset (all GPUs visible)")]
    ids = [x.strip() for x in raw.split(",") if x.strip()]
    if not ids:
        return [Finding(name, WARN, f"CUDA_VISIBLE_DEVICES={raw!r} hides every GPU", "unset it on GPU nodes")]
    dups = sorted({x for x in ids if ids.count(x) > 1})
    if dups:
        return [Finding(name, ERROR, f"CUDA_VISIBLE_DEVICES={raw} repeats {','.join(dups)}: ranks would share a "
                        "GPU and NCCL aborts ('Duplicate GPU detected')",
                        f"export CUDA_VISIBLE_DEVICES={','.join(dict.fromkeys(ids))}")]
    if ctx.gpus:
        known = {str(g["index"]) for g in ctx.gpus} | {g["uuid"] for g in ctx.gpus}
        bad = [x for x in ids if x not in known and not any(u.startswith(x) for u in known if u.startswith("GPU-"))]
        if bad:
            return [Finding(name, ERROR, f"CUDA_VISIBLE_DEVICES names unknown GPU(s) {','.join(bad)} "
                            f"({len(ctx.gpus)} present); CUDA stops at the first invalid id",
                            "list the node's GPUs with nvidia-smi -L")]
    return [Finding(name, OK, f"CUDA_VISIBLE_DEVICES={raw}")]


# --------------------------------------------------------------------------- network
VIRTUAL_NICS = ("lo", "docker", "veth", "br-", "virbr", "cni", "flannel", "cali", "kube", "ifb", "tunl")


def nccl_ifname_matches(spec: str, names: list[str]) -> list[str]:
    """Interfaces NCCL would accept for NCCL_SOCKET_IFNAME=spec ('^' excludes, '=' exact, else prefix)."""
    exclude, exact = spec.startswith("^"), False
    spec = spec.lstrip("^")
    if spec.startswith("="):
        exact, spec = True, spec[1:]
    pats = [p for p in spec.split(",") if p]
    hit = [n for n in names if any(n == p if exact else n.startswith(p) for p in pats)]
    return [n for n in names if n not in hit] if exclude else hit


def check_ifnames(ctx: Context) -> list[Finding]:
    nics = {n: a for n, a in ctx.nics().items() if a}  # up and with an IPv4 address
    real = sorted(n for n in nics if not n.startswith(VIRTUAL_NICS))
    have = ", ".join(f"{n}={nics[n][0]}" for n in sorted(nics))
    out = []
    for var, matcher in (("GLOO_SOCKET_IFNAME", lambda s, ns: [n for n in s.split(",") if n in ns]),
                         ("NCCL_SOCKET_IFNAME", nccl_ifname_matches)):
        val = ctx.env.get(var)
        if val:
            ok = matcher(val, sorted(nics))
            if ok:
                out.append(Finding(var, OK, f"{var}={val} -> {', '.join(ok)}"))
            else:
                out.append(Finding(var, ERROR, f"{var}={val} matches no up interface with IPv4 (have: {have})",
                                   f"export {var}=<interface carrying the node IP>"))
        elif len(real) > 1:
            out.append(Finding(var, WARN, f"unset on a host with {len(real)} NICs ({', '.join(real)}): the "
                               "library may pick the wrong network and hang at init",
                               f"export {var}=<interface carrying the node IP>"))
        else:
            out.append(Finding(var, OK, f"unset; single NIC ({', '.join(real) or 'loopback only'})"))
    return out


def check_nccl_ib(ctx: Context) -> list[Finding]:
    hca, gid = ctx.env.get("NCCL_IB_HCA"), ctx.env.get("NCCL_IB_GID_INDEX")
    if not hca and not gid:
        return [Finding("nccl_ib", OK, "NCCL_IB_HCA / NCCL_IB_GID_INDEX unset (NCCL auto-detects)")]
    if gid is not None and not gid.strip().lstrip("-").isdigit():
        return [Finding("nccl_ib", ERROR, f"NCCL_IB_GID_INDEX={gid!r} is not an integer", "export NCCL_IB_GID_INDEX=3")]
    root = Path(ctx.ib_root)
    devs = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    if not devs:
        return [Finding("nccl_ib", WARN, f"NCCL_IB_HCA={hca} but no RDMA device in {root}: NCCL falls back to TCP "
                        "sockets", "expected on CPU/dev machines; on GPU nodes load the IB driver (ibv_devices)")]
    if hca:
        matched = nccl_ifname_matches(",".join(p.split(":")[0] for p in hca.split(",")), devs)  # drop :port
        if not matched:
            return [Finding("nccl_ib", ERROR, f"NCCL_IB_HCA={hca} matches none of {', '.join(devs)}: NCCL silently "
                            "uses TCP", f"export NCCL_IB_HCA={devs[0].rstrip('0123456789')}")]
        devs = matched
    if gid is not None:
        gid_file = root / devs[0] / "ports" / "1" / "gids" / gid.strip()
        if not gid_file.exists() or set(gid_file.read_text().strip()) <= {"0", ":"}:
            return [Finding("nccl_ib", WARN, f"GID index {gid} is empty on {devs[0]} port 1",
                            "pick the RoCE v2 GID: show_gids (or leave NCCL_IB_GID_INDEX unset on InfiniBand)")]
    return [Finding("nccl_ib", OK, f"RDMA devices {', '.join(devs)}")]


# --------------------------------------------------------------------------- limits
def check_ulimit(ctx: Context) -> list[Finding]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 65536:
        fix = f"ulimit -n {hard if hard != resource.RLIM_INFINITY and hard >= 65536 else 1048576}"
        if hard != resource.RLIM_INFINITY and hard < 65536:
            fix += " after raising the hard limit (limits.conf, or docker --ulimit nofile=1048576:1048576)"
        return [Finding("ulimit_nofile", WARN, f"open files soft={soft} hard={hard}: Ray and NCCL run out of fds "
                        "on large jobs", fix)]
    return [Finding("ulimit_nofile", OK, f"open files soft={soft} hard={hard}")]


def check_shm(ctx: Context) -> list[Finding]:
    try:
        total = shutil.disk_usage(ctx.shm_path).total
    except OSError:
        return [Finding("shm", ERROR if ctx.gpus else WARN, f"{ctx.shm_path} missing",
                        "mount a tmpfs at /dev/shm (docker --shm-size=32g / --ipc=host)")]
    detail = f"{ctx.shm_path} {total / GiB:.1f} GiB"
    if total < GiB:
        return [Finding("shm", ERROR if ctx.gpus else WARN, detail + ": NCCL's shared-memory transport and "
                        "Ray's object store fail", "docker run --shm-size=32g (or --ipc=host)")]
    if total < 16 * GiB:
        return [Finding("shm", WARN, detail + ": caps Ray's object store", "docker run --shm-size=32g (or --ipc=host)")]
    return [Finding("shm", OK, detail)]


# --------------------------------------------------------------------------- field pitfalls
def check_mkl(ctx: Context) -> list[Finding]:
    layer, force = ctx.env.get("MKL_THREADING_LAYER"), ctx.env.get("MKL_SERVICE_FORCE_INTEL")
    mkl = _version("mkl-service") or _version("mkl")
    fix = "export MKL_THREADING_LAYER=GNU"
    if layer and layer.upper() not in {"INTEL", "SEQUENTIAL", "GNU", "TBB"}:
        return [Finding("mkl", WARN, f"MKL_THREADING_LAYER={layer} is not a valid layer", fix)]
    if layer and layer.upper() == "INTEL" and not force:
        return [Finding("mkl", WARN, "MKL_THREADING_LAYER=INTEL clashes with torch's GNU OpenMP (libgomp): "
                        "'MKL_THREADING_LAYER=INTEL is incompatible with libgomp.so.1'", fix)]
    if mkl and not layer and not force:
        return [Finding("mkl", WARN, f"MKL {mkl} installed and MKL_THREADING_LAYER unset: importing numpy after "
                        "torch aborts with the Intel/GNU OpenMP clash", fix + " (or MKL_SERVICE_FORCE_INTEL=1)")]
    return [Finding("mkl", OK, f"layer={layer or 'unset'}, mkl {'present' if mkl else 'absent'}")]


def check_numexpr(ctx: Context) -> list[Finding]:
    val, ncpu = ctx.env.get("NUMEXPR_MAX_THREADS"), os.cpu_count() or 1
    if val is not None and not (val.isdigit() and int(val) > 0):
        return [Finding("numexpr", WARN, f"NUMEXPR_MAX_THREADS={val!r} is not a positive integer",
                        "export NUMEXPR_MAX_THREADS=64")]
    if val is None and ncpu > 64:
        return [Finding("numexpr", WARN, f"NUMEXPR_MAX_THREADS unset on a {ncpu}-CPU host: numexpr caps itself at 64 "
                        "and warns from every process", "export NUMEXPR_MAX_THREADS=64 (submit.sh passes it on)")]
    return [Finding("numexpr", OK, f"NUMEXPR_MAX_THREADS={val or 'unset'}, {ncpu} CPUs")]


# --------------------------------------------------------------------------- Ray
def _has_token(env: Mapping[str, str]) -> bool:
    path = env.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    return bool(env.get("RAY_AUTH_TOKEN")) or (Path(path).is_file() and Path(path).stat().st_size > 0)


def check_ray(ctx: Context) -> list[Finding]:
    addr = ctx.env.get("RAY_ADDRESS")
    if not addr:
        return [Finding("ray", OK, "RAY_ADDRESS unset: connectivity not checked")]
    if addr in ("auto", "local"):
        return [Finding("ray", OK, f"RAY_ADDRESS={addr}: nothing to connect to")]
    if ctx.env.get("RAY_AUTH_MODE") != "token" or not _has_token(ctx.env):
        return [Finding("ray", ERROR, "RAY_AUTH_MODE=token and a token are needed to reach an mcore_rl cluster",
                        "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=<copy of the head's token>")]
    if addr.startswith(("http://", "https://")):
        return [Finding("ray", WARN, f"RAY_ADDRESS={addr} is a job-server URL; drivers need the GCS host:port",
                        "export RAY_ADDRESS=<head ip>:6379 (keep the URL in RAY_API_SERVER_ADDRESS)")]
    host, _, port = addr.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except (OSError, ValueError) as e:
        return [Finding("ray", ERROR, f"cannot reach GCS {addr}: {e}", "start the head (scripts/ray_head.sh) or "
                        "fix RAY_ADDRESS / the firewall")]
    code = ("import sys; from ray.scripts.scripts import main; "
            "sys.argv = ['ray', 'status', '--address', sys.argv[1]]; main()")
    try:
        r = subprocess.run([sys.executable, "-c", code, addr], env=dict(ctx.env), capture_output=True, text=True,
                           timeout=90)
    except subprocess.TimeoutExpired:
        return [Finding("ray", ERROR, f"`ray status --address {addr}` timed out", "check the head's logs")]
    if r.returncode != 0:
        last = (r.stderr.strip() or r.stdout.strip() or "?").splitlines()[-1][:200]
        return [Finding("ray", ERROR, f"`ray status` failed: {last}", "check the token and RAY_AUTH_MODE=token")]
    nodes = sum(1 for line in r.stdout.splitlines() if line.strip().startswith("1 node_"))
    return [Finding("ray", OK, f"GCS {addr} answers `ray status` ({nodes} active node(s))")]


CHECKS: list[tuple[str, Callable[[Context], list[Finding]]]] = [
    ("python", check_python),
    ("packages", check_packages),
    ("pip", check_pip),
    ("gpu", check_gpus),  # before the checks that use ctx.gpus
    ("cuda_visible_devices", check_visible_devices),
    ("interfaces", check_ifnames),
    ("nccl_ib", check_nccl_ib),
    ("ulimit", check_ulimit),
    ("shm", check_shm),
    ("mkl", check_mkl),
    ("numexpr", check_numexpr),
    ("ray", check_ray),
]


def run_checks(ctx: Context | None = None, checks=None) -> list[Finding]:
    ctx = ctx or Context()
    findings = []
    for name, fn in checks or CHECKS:
        try:
            findings.extend(fn(ctx))
        except Exception as e:  # a broken check must not hide the others
            findings.append(Finding(name, WARN, f"check crashed: {type(e).__name__}: {e}", "report this"))
    return findings


def render(findings: list[Finding]) -> str:
    width = max(len(f.check) for f in findings) + 2
    lines = [f"mcore_rl doctor - {socket.gethostname()}, {platform.platform(terse=True)}", "",
             f"{'STATUS':<7}{'CHECK':<{width}}DETAIL"]
    for f in findings:
        lines.append(f"{f.severity.upper() if f.severity != OK else OK:<7}{f.check:<{width}}{f.detail}")
        if f.severity != OK and f.fix:
            lines.append(f"{'':<7}{'':<{width}}fix: {f.fix}")
    counts = {s: sum(f.severity == s for f in findings) for s in (OK, WARN, ERROR)}
    verdict = "BLOCKED" if counts[ERROR] else "no blockers"
    lines += ["", f"{counts[OK]} ok, {counts[WARN]} warn, {counts[ERROR]} error: {verdict}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mcore_rl.preflight.doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(argv)
    findings = run_checks()
    blocked = any(f.severity == ERROR for f in findings)
    if args.json:
        print(json.dumps({"blocked": blocked, "findings": [asdict(f) for f in findings]}, indent=1))
    else:
        print(render(findings))
    return 1 if blocked else 0


if __name__ == "__main__":
    sys.exit(main())
