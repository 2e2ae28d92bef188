#!/usr/bin/env python3
"""Instructions per element of the row kernels' hot loops, read from their SASS (no GPU needed).

    python scripts/sass_count.py                      # builds flce_rows.cu for sm_90a
    python scripts/sass_count.py --arch sm_100 --object build/flce_rows.o --kernel row_grad

Compiles csrc/cuda/flce_rows.cu with nvcc for one architecture (or reads --object), dumps the
SASS with cuobjdump (PATH, $CUOBJDUMP, the CUDA toolkit, or pip's nvidia-cuda-cuobjdump), and
for every instance of row_stats_kernel / row_grad_kernel finds the tile loop: the innermost loop
(a backward branch) whose body holds the global loads of a tile. Its body is counted
instruction by instruction and divided by the columns a thread handles per iteration
(kPerThread = 16): the hot path's cost per logit. A loop body with branches inside (bounds or
flag checks per element) is counted whole, an upper bound on the path taken; the kernels' whole
-tile loops have none. Prints one line per instance: total, per element, and the classes that
matter for an issue-bound loop (MUFU: the exp; LDG/STG: memory; BRA/BAR: control).
"""
import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PER_THREAD = 16  # flce_rows.cu kPerThread: columns per thread per tile
INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
FUNC = re.compile(r"Function\s*:\s*(\S+)")


def cuobjdump():
    for cand in (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"),
                 "/usr/local/cuda/bin/cuobjdump"):
        if cand and os.path.exists(cand):
            return cand
    import site

    for base in site.getsitepackages() + [site.getusersitepackages()]:
        hits = glob.glob(os.path.join(base, "nvidia", "*", "bin", "cuobjdump"))
        if hits:
            return hits[0]
    sys.exit("cuobjdump not found: install the toolkit's, or pip install nvidia-cuda-cuobjdump, "
             "or set CUOBJDUMP")


def build(arch, out):
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    cmd = [nvcc, "-std=c++20", "-O3", "--expt-relaxed-constexpr", "-D__CUDA_NO_HALF_OPERATORS__",
           "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
           "-D__CUDA_NO_HALF2_OPERATORS__", f"-gencode=arch=compute_{arch[3:]},code={arch}",
           "-I" + os.path.join(ROOT, "csrc"), "-I" + os.path.join(ROOT, "csrc", "include"),
           "-c", os.path.join(ROOT, "csrc", "cuda", "flce_rows.cu"), "-o", out]
    subprocess.run(cmd, check=True)


def functions(sass):
    """{mangled name: [(address, instruction text)]}"""
    out, name = {}, None
    for line in sass.splitlines():
        m = FUNC.search(line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = INSTR.match(line)
        if m and name:
            out[name].append((int(m.group(1), 16), m.group(2)))
    return out


def demangle(name):
    try:
        return subprocess.run(["c++filt", name], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return name


def tile_loop(instrs):
    """The instructions of the innermost backward-branch loop that holds a global load."""
    best = None
    for i, (addr, text) in enumerate(instrs):
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target > addr:
            continue
        body = [t for a, t in instrs if target <= a <= addr]
        if not any(t.split()[0].startswith("LDG") or " LDG" in t for t in body):
            continue
        if best is None or len(body) < len(best):
            best = body
    return best


def opcode(text):
    parts = text.split()
    op = parts[1] if parts[0].startswith("@") else parts[0]
    return op.split(".")[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--object", help="an object or cubin holding flce_rows.cu's kernels")
    ap.add_argument("--kernel", default="row_", help="substring of the kernels to count")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        obj = args.object
        if obj is None:
            obj = os.path.join(tmp, "flce_rows.o")
            build(args.arch, obj)
        sass = subprocess.run([cuobjdump(), "-sass", "-arch", args.arch, obj], check=True,
                              capture_output=True, text=True).stdout
    rows = []
    for name, instrs in functions(sass).items():
        pretty = demangle(name)
        short = re.sub(r"flce::cuda::\(anonymous namespace\)::", "", pretty)
        short = re.sub(r"\(flce::cuda::\w+\)$", "", short)
        if args.kernel not in short or not ("row_stats" in short or "row_grad" in short):
            continue
        body = tile_loop(instrs)
        if body is None:
            rows.append((short, None, None, {}))
            continue
        ops = collections.Counter(opcode(t) for t in body)
        rows.append((short, len(body), len(body) / PER_THREAD, ops))
    print(f"{args.arch}: instructions in the tile loop of each row kernel instance "
          f"(per element = / {PER_THREAD} columns per thread)")
    for short, total, per, ops in sorted(rows):
        if total is None:
            print(f"{short:70s} no tile loop found")
            continue
        classes = {k: ops.get(k, 0) for k in ("MUFU", "LDG", "STG", "BRA", "BAR", "FFMA", "FADD",
                                              "FMUL", "FMNMX", "F2F", "F2FP", "PRMT", "ISETP",
                                              "FSETP", "SHF", "IMAD", "LEA", "FSEL", "SEL")}
        desc = " ".join(f"{k}={v}" for k, v in classes.items() if v)
        print(f"{short:70s} {total:5d} {per:6.1f}/elem  {desc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
