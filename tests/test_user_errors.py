"""Mistakes users make, answered in their terms: which argument, what it is, and the
fix; and `hetpar solve file.py:FN` importing like `python file.py`."""

from __future__ import annotations

import jax
import pytest

import hetpar
from hetpar.errors import HetparError
from hetpar.signature import bind_call
from hetpar.workloads import load_workload


def _step(state, batch, lr):
    return state, batch


def test_a_forgotten_static_argnums_names_the_argument_and_the_fix():
    with pytest.raises(HetparError, match=r"argument 2 \('lr'\) is a str \('fast'\).*static_argnums=\(2,\)"):
        bind_call(_step, ({"w": jax.numpy.ones(2)}, jax.numpy.ones(4), "fast"), {}, 1)
    with pytest.raises(HetparError, match=r"argument 0 \('state'\)\['opt'\] is a object"):
        bind_call(_step, ({"opt": object()}, jax.numpy.ones(4), 0.1), {}, 1)
    # What JAX traces passes: arrays, Python numbers, typed PRNG keys, abstract shapes.
    bind_call(_step, ({"key": jax.random.key(0), "n": 3}, jax.ShapeDtypeStruct((4,), "float32"), 0.1), {}, 1)
    bind_call(_step, ({"w": 1.0}, jax.numpy.ones(4), "fast"), {}, 1, static_argnums=(2,))


def test_a_parallelized_step_says_it_before_tracing():
    step = hetpar.parallelize(_step, cluster=hetpar.Cluster.virtual({"A100": 2}))
    with pytest.raises(HetparError, match="static_argnums"):
        step({"w": jax.numpy.ones(2)}, jax.numpy.ones(4), "fast")


def test_solve_imports_a_file_like_python_does(tmp_path):
    """`hetpar solve path/to/train.py:setup` lets train.py import the modules beside it."""
    (tmp_path / "my_model_lib.py").write_text("from models import mlp\n\ndef build():\n    return mlp.setup(batch_size=8, depth=2)\n")
    (tmp_path / "train_script.py").write_text("import my_model_lib\n\ndef setup(batch_size=None):\n    return my_model_lib.build()\n")
    workload = load_workload(f"{tmp_path / 'train_script.py'}:setup")
    assert workload.step is not None and len(workload.args) == 2
