"""Steps measured on a GPU, priced here without one: the check of the estimator's
physics that any machine can run between the sessions that are lent a GPU.

`data/h100_tinyllama_1b.json` holds what `one_device_step.py` measured on an H100
(2026-11-27): a 1.26B Llama's step on one GPU at 2 and 4 sequences, and the layer
profiles made there. Each is planned again here, abstractly (`jax.eval_shape`), for
one H100 (a cluster of one, as a cluster file would say it), priced from the device
catalog alone and from the stored profile, and compared with the measured step:

- the profile's price should equal the one the GPU machine printed (the same file; a
  difference means the planner read it otherwise, e.g. layers whose signature no
  longer matches under this JAX, which `hetpar.pipeline` warns of);
- the catalog's error is what a change to the physics (`solver/cost`, the catalog)
  should move toward zero: on the H100 it was -50% and -54%.

Ends with
RESULT catalog_err_b2=<x> catalog_err_b4=<x> profile_err_b2=<x> profile_err_b4=<x>
(errors: predicted over the median measured step, less one).
Run: .venv/bin/python benchmarks/gpu_measured.py
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hetpar  # noqa: E402
from models import llama  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "h100_tinyllama_1b.json"
ONE_H100 = "name: one-h100\ngroups:\n  - {name: h100, device: H100, nodes: 1, devices_per_node: 1}\n"


def main() -> None:
    data = json.loads(DATA.read_text())
    print(f"{data['device']}: {data['what']}")
    errors = {}
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "cluster.yaml").write_text(ONE_H100)
        cluster = hetpar.Cluster.from_file(str(Path(folder) / "cluster.yaml"))
        for batch, times in data["measured_step_s"].items():
            measured = statistics.median(times)
            profile = Path(folder) / f"layers{batch}.json"
            profile.write_text(json.dumps(data["profiles"][batch]))
            w = llama.setup(int(batch), llama.TINYLLAMA_1B, abstract=True)
            there = data["predicted_there_s"][batch]
            for label, source in (("catalog", None), ("profile", str(profile))):
                plan = hetpar.make_plan(w.step, (w.state, w.batch), cluster, num_stages=1, num_microbatches=1, profile=source)
                predicted = plan.predicted_step_time_s
                errors[f"{label}_err_b{batch}"] = predicted / measured - 1
                print(f"{batch} sequences, {label:>7}: predicted {predicted * 1e3:.1f} ms here, "
                      f"{there[label] * 1e3:.1f} ms on the GPU machine; measured {measured * 1e3:.1f} ms "
                      f"({predicted / measured - 1:+.1%})")
    print("RESULT " + " ".join(f"{k}={v:+.3f}" for k, v in sorted(errors.items())))


if __name__ == "__main__":
    main()
