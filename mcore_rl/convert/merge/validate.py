"""Compare an HF safetensors directory with a reference one, tensor by tensor (streaming)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mcore_rl.convert.hf_io import HFCheckpoint


class ValidationFailed(Exception):
    pass


@dataclass
class Report:
    exact: int = 0
    close: int = 0
    missing: list[str] = field(default_factory=list)  # in the reference, not in the output
    extra: list[str] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)  # "name: why"

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.bad)

    def summary(self) -> str:
        lines = [f"{self.exact} tensors bit-exact, {self.close} within tolerance, "
                 f"{len(self.bad)} different, {len(self.missing)} missing, {len(self.extra)} extra"]
        lines += [f"  missing: {n}" for n in self.missing[:5]] + [f"  extra: {n}" for n in self.extra[:5]]
        return "\n".join(lines + [f"  {b}" for b in self.bad[:10]])


def compare(out_dir: str, ref_dir: str, atol: float = 0.0, rtol: float = 0.0) -> Report:
    """Every reference tensor against the output: same name, shape, dtype, values."""
    out, ref = HFCheckpoint(out_dir), HFCheckpoint(ref_dir)
    rep = Report(missing=sorted(set(ref.names()) - set(out.names())),
                 extra=sorted(set(out.names()) - set(ref.names())))
    for name in sorted(set(ref.names()) & set(out.names())):
        a, b = out.get(name), ref.get(name)
        if a.shape != b.shape or a.dtype != b.dtype:
            rep.bad.append(f"{name}: {tuple(a.shape)} {a.dtype} vs reference {tuple(b.shape)} {b.dtype}")
        elif torch.equal(a, b):
            rep.exact += 1
        elif (atol or rtol) and torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol):
            rep.close += 1
        else:
            diff = (a.float() - b.float()).abs().max().item()
            rep.bad.append(f"{name}: max |diff| {diff:.3g}")
    out.close()
    ref.close()
    return rep


def checker(ref_dir: str | None, atol: float = 0.0, rtol: float = 0.0):
    """A `check(tmp_dir)` that refuses output which does not match `ref_dir` (None: no check)."""
    if ref_dir is None:
        return None
    HFCheckpoint(ref_dir)  # a bad reference is refused before any work

    def check(tmp_dir: str) -> Report:
        rep = compare(tmp_dir, ref_dir, atol, rtol)
        if not rep.ok:
            raise ValidationFailed(f"merged model differs from {ref_dir}:\n{rep.summary()}")
        print(f"validated against {ref_dir}: {rep.summary()}")
        return rep

    return check
