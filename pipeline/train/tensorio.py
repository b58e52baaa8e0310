"""Minimal .npy reader and .safetensors writer with no dependency beyond torch (the GPU machine
has torch but may lack numpy/safetensors)."""
import ast
import ctypes
import json
import struct

import torch

_NPY_DTYPES = {"|u1": torch.uint8, "<f4": torch.float32, "<f8": torch.float64}
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def load_npy(path):
    """A C-order little-endian .npy file as a torch tensor."""
    with open(path, "rb") as f:
        magic = f.read(8)
        if magic[:6] != b"\x93NUMPY":
            raise ValueError(f"{path}: not a .npy file")
        hlen = struct.unpack("<H", f.read(2))[0] if magic[6] == 1 else struct.unpack("<I", f.read(4))[0]
        header = ast.literal_eval(f.read(hlen).decode("latin1"))
        if header["fortran_order"] or header["descr"] not in _NPY_DTYPES:
            raise ValueError(f"{path}: unsupported layout {header}")
        data = bytearray(f.read())
    return torch.frombuffer(data, dtype=_NPY_DTYPES[header["descr"]]).reshape(header["shape"])


def save_safetensors(tensors, path, metadata=None):
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        raw = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)


_ST_TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def load_safetensors(path):
    """A .safetensors file as {name: tensor} (and its metadata), needing only torch."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = bytearray(f.read())
    meta = header.pop("__metadata__", {})
    out = {}
    for name, h in header.items():
        a, b = h["data_offsets"]
        out[name] = torch.frombuffer(data[a:b], dtype=_ST_TORCH[h["dtype"]]).reshape(h["shape"]).clone()
    return out, meta
