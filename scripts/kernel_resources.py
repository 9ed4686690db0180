#!/usr/bin/env python3
"""Registers, stack and spills of every tpar kernel, as ptxas reports them through NVRTC.

Compiles each kernel file of crates/tpar/kernels with the options tpar uses at run time
(backend/cuda/nvrtc.rs: --std=c++17 --fmad=false -default-device) plus `-Xptxas=-v`, for one
architecture, and prints one row per kernel. Extra `-D` arguments are passed on, as
TPAR_KERNEL_DEFINES does, so a knob of tuning.cuh can be compared both ways before a GPU run:

    python3 scripts/kernel_resources.py                      # sm_90, every file
    python3 scripts/kernel_resources.py --arch 89 ring.cu -DTPAR_LAUNCH_MIN_BLOCKS=1

Needs libnvrtc.so.13 on the loader's path (`pip install nvidia-cuda-nvrtc` and
LD_LIBRARY_PATH=.../nvidia/cu13/lib, as .ci/run does). Registers and spills are no timing:
a kernel that spills in a wait loop may or may not be slower; the GPU decides.
"""

import argparse
import ctypes
import pathlib
import re
import sys

KERNELS = pathlib.Path(__file__).resolve().parent.parent / "crates" / "tpar" / "kernels"
PROPERTIES = re.compile(r"Function properties for (\w+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")


def ptxas_log(nvrtc, path, headers, options):
    """The compile log of one kernel file, with ptxas's resource lines; `headers` are the
    (name, text) pairs NVRTC may include, `options` the compile options."""
    source = path.read_bytes()
    header_names = (ctypes.c_char_p * len(headers))(*[name for name, _ in headers])
    header_sources = (ctypes.c_char_p * len(headers))(*[text for _, text in headers])
    program = ctypes.c_void_p()
    created = nvrtc.nvrtcCreateProgram(
        ctypes.byref(program),
        source,
        path.name.encode(),
        len(headers),
        header_sources,
        header_names,
    )
    if created != 0:
        sys.exit(f"nvrtcCreateProgram failed for {path.name}: {created}")
    option_array = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    compiled = nvrtc.nvrtcCompileProgram(program, len(options), option_array)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    text = log.value.decode(errors="replace")
    if compiled != 0:
        sys.exit(f"{path.name} did not compile ({' '.join(options)}):\n{text}")
    return text


def rows(log):
    """(kernel, registers, stack bytes, spill store bytes, spill load bytes) per entry point."""
    kernel, frame = None, None
    for line in log.splitlines():
        if match := PROPERTIES.search(line):
            kernel, frame = match.group(1), None
        elif kernel and (match := FRAME.search(line)):
            frame = tuple(int(g) for g in match.groups())
        elif kernel and frame and (match := USED.search(line)):
            # Out-of-line device functions have properties too; only kernels are tpar_*.
            if kernel.startswith("tpar_"):
                yield (kernel, int(match.group(1)), *frame)
            kernel, frame = None, None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="kernel files (default: every .cu)")
    parser.add_argument("--arch", default="90", help="compute capability x 10 (default 90)")
    args, defines = parser.parse_known_args()
    unknown = [d for d in defines if not d.startswith("-D")]
    if unknown:
        parser.error(f"only -DNAME=VALUE may follow the options, not {unknown}")
    files = [KERNELS / f for f in args.files] or sorted(KERNELS.glob("*.cu"))
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        sys.exit(f"no kernel file {', '.join(missing)} (the files are in {KERNELS})")
    try:
        nvrtc = ctypes.CDLL("libnvrtc.so.13")
    except OSError as e:
        sys.exit(
            f"libnvrtc.so.13 not found ({e}): pip install nvidia-cuda-nvrtc and put its nvidia/cu13/lib on LD_LIBRARY_PATH"
        )
    headers = [(h.name.encode(), h.read_bytes()) for h in sorted(KERNELS.glob("*.cuh"))]
    options = [
        f"--gpu-architecture=sm_{args.arch}",
        "--std=c++17",
        "--fmad=false",
        "-default-device",
        "-Xptxas=-v",
        *defines,
    ]
    print(f"sm_{args.arch} {' '.join(defines) or '(no -D)'}")
    print(f"{'kernel':36} {'regs':>5} {'stack':>6} {'spill st':>9} {'spill ld':>9}")
    for path in files:
        for kernel, registers, stack, stores, loads in rows(
            ptxas_log(nvrtc, path, headers, options)
        ):
            print(f"{kernel:36} {registers:>5} {stack:>6} {stores:>9} {loads:>9}")


if __name__ == "__main__":
    main()
