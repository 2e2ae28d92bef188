#!/usr/bin/env python3
"""Check that a flce wheel carries GPU code for exactly the arch list it was asked to build.

    python scripts/check_wheel.py dist/flce-*.whl --arch-list "8.0;9.0a;10.0" [--ptx newest]
    python scripts/check_wheel.py python --arch-list "9.0a"     # an in-place build

Reads flce/_build_info.py from the wheel (its recorded arch list must equal the expected one,
normalized the same way setup.py normalizes it), then lists the extension's embedded cubins and
PTX with cuobjdump and compares them with the expected SASS and PTX targets. A wheel whose build
compiled no CUDA sources has no device code: that passes, with a note, only if the extension
indeed has no .nv_fatbin section; a wheel with kernels fails on any mismatch, or when no
cuobjdump is found to list them. Exit status 0 on success, 1 on a mismatch.
"""
import argparse
import glob
import os
import re
import runpy
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_build = runpy.run_path(os.path.join(ROOT, "python", "flce", "_build.py"))


def elf_sections(path):
    """Section names of a 64-bit little-endian ELF file (enough for Linux x86_64/aarch64)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    def header(i):
        return struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
    strtab = header(shstrndx)
    str_off = strtab[4]
    names = []
    for i in range(shnum):
        name_off = header(i)[0]
        end = data.index(b"\0", str_off + name_off)
        names.append(data[str_off + name_off:end].decode())
    return names


def find_cuobjdump():
    cands = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda", "/usr/local/cuda-13.0"):
        if home:
            cands.append(os.path.join(home, "bin", "cuobjdump"))
    for path in sys.path:
        cands += sorted(glob.glob(os.path.join(path, "nvidia", "cu*", "bin", "cuobjdump")))
        cands += sorted(glob.glob(os.path.join(path, "nvidia", "cuda_cuobjdump", "bin",
                                               "cuobjdump")))
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


def listed_targets(cuobjdump, so, what):
    """{object: [sm_XY, ...]} from `cuobjdump --list-elf` / `--list-ptx` lines such as
    'ELF file    2: flce_grad.sm_90a.cubin'."""
    out = subprocess.run([cuobjdump, f"--list-{what}", so], capture_output=True, text=True)
    if out.returncode != 0 and "does not contain device code" not in out.stdout + out.stderr:
        raise RuntimeError(f"{cuobjdump} --list-{what} failed: {out.stderr.strip()}")
    print(f"  cuobjdump --list-{what}:")
    for line in out.stdout.splitlines():
        print(f"    {line}")
    per_object = {}
    for obj, sm in re.findall(r":\s*(\S+?)\.(sm_\d+[af]?)\.(?:cubin|ptx)", out.stdout):
        per_object.setdefault(obj, set()).add(sm)
    return {obj: sorted(sms) for obj, sms in per_object.items()}


class _Tree:
    """A directory holding flce/ (an in-place build: python/), read like a wheel."""

    def __init__(self, root):
        self.root = root

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def namelist(self):
        return sorted(os.path.relpath(p, self.root).replace(os.sep, "/")
                      for p in glob.glob(os.path.join(self.root, "flce", "*")))

    def read(self, name):
        with open(os.path.join(self.root, name), "rb") as f:
            return f.read()

    def extract(self, name, _tmp):
        return os.path.join(self.root, name)


def _open(path):
    return _Tree(path) if os.path.isdir(path) else zipfile.ZipFile(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("wheel", help="a wheel, or a directory holding flce/ (e.g. python)")
    ap.add_argument("--arch-list", required=True,
                    help='the TORCH_CUDA_ARCH_LIST of the build; "" for a CPU-only wheel')
    ap.add_argument("--ptx", default=os.environ.get("FLCE_PTX", "newest"),
                    choices=_build["PTX_POLICIES"])
    args = ap.parse_args()

    # "" (or "cpu"): a CPU-only wheel, which must carry no device code at all.
    cpu_only = args.arch_list.strip().lower() in ("", "cpu")
    archs = [] if cpu_only else _build["parse_arch_list"](args.arch_list, args.ptx)
    want_arch = _build["format_arch_list"](archs)
    want_sass = sorted(a.sm for a in archs)
    # cuobjdump names PTX by its virtual arch with an sm_ prefix (x.1.sm_100.ptx).
    want_ptx = sorted(a.sm for a in archs if a.ptx)
    print(f"check_wheel: {os.path.basename(args.wheel)}")
    print(f"  expected arch list {want_arch!r}: SASS {want_sass}, PTX {want_ptx}")

    failures = []
    with tempfile.TemporaryDirectory() as tmp, _open(args.wheel) as whl:
        names = whl.namelist()
        sos = [n for n in names if re.match(r"flce/_C[.\w-]*\.so$", n)]
        if len(sos) != 1 or "flce/_build_info.py" not in names:
            print(f"FAIL: the wheel must hold flce/_C*.so and flce/_build_info.py; has {names}")
            return 1
        info = {}
        exec(whl.read("flce/_build_info.py").decode(), info)
        info = info["INFO"]
        print(f"  build info: {info}")
        if info.get("arch_list") != want_arch:
            failures.append(f"build info arch_list {info.get('arch_list')!r} != {want_arch!r}")
        if info.get("sass") != [a.sm for a in archs] or info.get("ptx") != [
                a.compute for a in archs if a.ptx]:
            failures.append(f"build info sass/ptx {info.get('sass')}/{info.get('ptx')} do not "
                            "match the arch list")
        so = whl.extract(sos[0], tmp)
        has_fatbin = ".nv_fatbin" in elf_sections(so)
        n_cu = int(info.get("cuda_sources", 0))
        print(f"  {sos[0]}: {'has' if has_fatbin else 'no'} .nv_fatbin section; build compiled "
              f"{n_cu} CUDA source(s)")
        if cpu_only:
            if has_fatbin or info.get("cuda") is not None:
                failures.append("a CPU-only wheel must have no device code and cuda=None")
        elif not has_fatbin:
            if n_cu:
                failures.append(f"{n_cu} CUDA sources were compiled but the extension has no "
                                "device code")
            else:
                print("  NOTE: this build has no CUDA kernels (no csrc/cuda/*.cu): there is no "
                      "device code to check; the arch list is checked through the build info only")
        else:
            cuobjdump = find_cuobjdump()
            if cuobjdump is None:
                failures.append("the extension has device code but no cuobjdump was found "
                                "(pip install nvidia-cuda-cuobjdump, or set CUOBJDUMP)")
            else:
                sass = listed_targets(cuobjdump, so, "elf")
                ptx = listed_targets(cuobjdump, so, "ptx")
                # Every compiled .cu must carry exactly the list, not just their union.
                objects = sorted(set(sass) | set(ptx))
                print(f"  {len(objects)} device object(s): {', '.join(objects)}")
                if not objects:
                    failures.append("cuobjdump lists no device code in a .nv_fatbin extension")
                if len(objects) != n_cu:
                    failures.append(f"{len(objects)} device objects for {n_cu} CUDA sources")
                for obj in objects:
                    got_sass, got_ptx = sass.get(obj, []), ptx.get(obj, [])
                    print(f"  {obj}: SASS {got_sass}, PTX {got_ptx}")
                    if got_sass != want_sass:
                        failures.append(f"{obj}: SASS {got_sass} != expected {want_sass}")
                    if got_ptx != want_ptx:
                        failures.append(f"{obj}: PTX {got_ptx} != expected {want_ptx}")
    for f in failures:
        print(f"FAIL: {f}")
    if not failures:
        print("check_wheel: OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
