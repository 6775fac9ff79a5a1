"""Whether every CUDA kernel compiles to the same machine code at two commits.

    python tools/sass_diff.py BASE [HEAD]      (git revisions; HEAD by default)

For a change that should only move or rename code (a file to another folder,
an include line, a comment): builds every .cu object of _dsv4_cuda and
_dsv4_testing_cuda at both revisions with CMakeLists.txt's own flags (both
-gencode targets), dumps each object's SASS with cuobjdump and compares it
kernel by kernel, keyed by the .cu's file name, the arch and the kernel's name.
Exit status 1 when a kernel differs or exists at one revision only.

Not compared: the source path cuobjdump prints per object, and the tag nvcc
mangles into the names of kernels in an anonymous namespace (a hash of the
source's path). Line info (-lineinfo) is not part of -sass output.
Needs nvcc (no GPU), and cuobjdump with nvdisasm on PATH, beside nvcc or from
`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`. Compiles everything
twice: minutes per revision.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# <length><anonymous namespace tag>: the tag hashes the source's path
ANON = re.compile(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+")


def _tool(name: str) -> str:
    found = shutil.which(name)
    if not found:
        for d in sys.path:   # the pip wheels' bin folder (nvidia/cu*/bin)
            hits = glob.glob(os.path.join(d, "nvidia", "cu*", "bin", name))
            if hits:
                found = hits[0]
                break
    if not found:
        sys.exit(f"sass_diff: {name} not found (pip install nvidia-cuda-cuobjdump "
                 f"nvidia-cuda-nvdisasm, or put the CUDA toolkit's bin on PATH)")
    return found


def build(rev: str, work: str, jobs: int) -> dict[str, str]:
    """{.cu file name: its SASS} for every CUDA object at `rev`."""
    src, out = os.path.join(work, "src"), os.path.join(work, "build")
    os.makedirs(src)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
    subprocess.run(["cmake", "-S", src, "-B", out, "-G", "Ninja", "-DDSV4_BUILD_TESTING=ON",
                    f"-DPython_EXECUTABLE={sys.executable}"], check=True, stdout=subprocess.DEVNULL)
    targets = subprocess.run(["ninja", "-C", out, "-t", "targets", "all"], check=True,
                             capture_output=True, text=True).stdout
    objects = sorted({line.split(":")[0] for line in targets.splitlines()
                      if line.split(":")[0].endswith(".cu.o")})
    if not objects:
        sys.exit(f"sass_diff: no CUDA objects at {rev} (did CMake find nvcc?)")
    print(f"{rev}: compiling {len(objects)} CUDA objects", flush=True)
    subprocess.run(["ninja", "-C", out, f"-j{jobs}", *objects], check=True,
                   stdout=subprocess.DEVNULL)
    cuobjdump = _tool("cuobjdump")
    env = dict(os.environ, PATH=os.path.dirname(_tool("nvdisasm")) + os.pathsep
               + os.environ.get("PATH", ""))
    sass = {}
    for obj in objects:
        name = os.path.basename(obj)[:-len(".o")]
        assert name not in sass, f"two objects of one name: {name}"
        sass[name] = subprocess.run([cuobjdump, "-sass", os.path.join(out, obj)], check=True,
                                    capture_output=True, text=True, env=env).stdout
    return sass


def kernels(sass: dict[str, str]) -> dict[tuple[str, str, str], list[str]]:
    """(file, arch, kernel) -> the kernel's SASS lines."""
    out: dict[tuple[str, str, str], list[str]] = {}
    for name, text in sass.items():
        arch, key = None, None
        for line in text.splitlines():
            m = re.match(r"\s*arch = (sm_\w+)", line)
            if m:
                arch, key = m.group(1), None
                continue
            m = re.match(r"\s*Function : (\S+)", line)
            if m:
                key = (name, arch, ANON.sub("<anon>", m.group(1)))
                assert key not in out, key
                out[key] = []
            elif key:
                out[key].append(ANON.sub("<anon>", line))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base")
    ap.add_argument("head", nargs="?", default="HEAD")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--keep", help="build in this folder and keep it (default: a temporary one)")
    args = ap.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="sass_diff.")
    try:
        a = kernels(build(args.base, os.path.join(work, "base"), args.jobs))
        b = kernels(build(args.head, os.path.join(work, "head"), args.jobs))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    bad = 0
    for key in sorted(set(a) | set(b)):
        if key not in b or key not in a:
            bad += 1
            print(f"only at {args.base if key not in b else args.head}: {' '.join(key)}")
        elif a[key] != b[key]:
            bad += 1
            print(f"differs: {' '.join(key)}")
    same = sum(1 for k in set(a) & set(b) if a[k] == b[k])
    print(f"{same} kernels (per .cu and arch) with identical SASS, {bad} differ or are missing")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
