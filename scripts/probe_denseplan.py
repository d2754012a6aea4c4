"""Probe (session 23, to go once its finding is in docs/PERF.md): densenet121's GPU plan at batch 32,
its activation layout and what each convolution does with its layouts (run 90's profile had 62 ATen
elementwise launches per call, 291 µs, where reduce-overhead has none)."""

import collections
import sys

import torch

import streamfuse
from streamfuse.bench import models as bm

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
batch = int(sys.argv[1]) if len(sys.argv) > 1 else 32
spec = [s for s in bm.MODELS if s.name == "densenet121"][0]
model = spec.build(False).eval().to(device)
x = bm.make_inputs(spec, model, batch, False, device, torch.float32, 0)
with torch.no_grad():
    lines = streamfuse.compile(model, x).explain(source=False).splitlines()
print(lines[0])
print("\n".join(line for line in lines if "activation layout" in line))
convs = [line for line in lines if line.startswith("k") and "_convolution" in line.split()[0]]
print(len(convs), "convolutions:", collections.Counter(line.split("cuDNN): ", 1)[-1][-150:] for line in convs))
print(collections.Counter(line.split("[aten]")[1][:120] for line in lines
                          if line.startswith("k") and "[aten]" in line and "_convolution" not in line.split()[0]))
