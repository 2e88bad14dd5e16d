"""Differentiating a forward one segment at a time (autosp/passes/segments.py) gives the joint that differentiating
it whole gives, equation for equation and name for name, and traces each distinct segment once."""
import dataclasses

import pytest
import torch

import autosp
from autosp.ir.core import Role
from autosp.passes import segments
from autosp.passes.autodiff import differentiable_inputs, differentiate, split_boundary
from autosp.run.meshes import fake_world, planning_mesh
from tests import zoo


def _same(a, b) -> bool:
    return (str(a.graph) == str(b.graph) and a.boundary == b.boundary and a.diff_inputs == b.diff_inputs
            and a.diff_outputs == b.diff_outputs and a.n_primals == b.n_primals)


def _segmented(fwd):
    """The joint made by segments alone (None where the forward is not cut), and the whole one."""
    whole = differentiate(fwd, whole=True)
    return segments.differentiate_segments(fwd, differentiable_inputs(fwd), whole.diff_outputs), whole


# a view's strides (Mamba-2's reshapes), a parameter no gradient reaches (DeepSeek-V3.2's indexer: zeros), the
# gated delta rule's chunk loop, sinks and MoE routing, a tied embedding (its gradient summed across segments)
@pytest.mark.parametrize("name", ["mamba2", "deepseek_v32", "qwen3_next", "gpt_oss", "gemma"])
def test_the_zoo_differentiated_by_segments_is_the_whole_joint(name, monkeypatch):
    monkeypatch.setattr(segments, "DISTINCT", 1.0)      # 2 layers hardly repeat: cut them all the same
    with fake_world(2):
        model, fn = zoo.build(name)
        params = {k: v.detach().requires_grad_(True) for k, v in model.named_parameters()}
        ids = torch.zeros(2, 64, dtype=torch.long)
        _, local = autosp.shard(fn, planning_mesh(2)).graphs(params, ids, ids)
        fwd = split_boundary(local).graph
        seg, whole = _segmented(fwd)
        assert seg is not None and len(segments.cuts(fwd, differentiable_inputs(fwd))) >= 2
        assert _same(seg, whole), name
        assert name != "gemma" or model.config.tie_word_embeddings
        assert _same(differentiate(fwd), whole)            # differentiate's own path is the segments'


def test_a_planned_step_tiled_with_sharded_parameters_traces_each_layer_once(monkeypatch):
    """The planner's step (meta, parameters gathered a layer ahead, MLPs and loss tiled): the same joint, and the
    4 layers' segments traced once each kind."""
    from autosp.passes.autodiff import on_device
    from autosp.remat import _by_id, _tiled
    from autosp.run import plan
    from autosp.run.models import model_config
    traced = []
    inner = segments._trace

    def counting(seg, *args):
        traced.append(seg.a)
        return inner(seg, *args)
    monkeypatch.setattr(segments, "_trace", counting)
    with fake_world(2):
        tracer = plan.Tracer(model_config("tiny"), planning_mesh(2), torch.float32, 1, 2, shard_params=True)
        local = tracer.trace(1024, single=False).local
        chains, deepest = plan._deepest(local)
        local = _tiled(local, _by_id({c.name: deepest[c.id] for c in chains if c.id in deepest}, chains), chains)
        fwd = on_device(split_boundary(local).graph, "meta", "cpu")
        seg, whole = _segmented(fwd)
    assert "split_with_sizes" in str(fwd) and "all_gather_param" in str(fwd)
    assert _same(seg, whole)
    n = len(segments.cuts(fwd, differentiable_inputs(fwd))) + 1
    assert n >= 8 and len(traced) < n - 2, (n, traced)


def test_a_forward_with_no_cut_is_differentiated_whole():
    def loss(w, x):
        return (x @ w).sum()
    w = torch.randn(4, 4, requires_grad=True)
    graph = autosp.trace(loss, w, torch.randn(3, 4))
    graph = graph.replace(inputs=(dataclasses.replace(graph.inputs[0], role=Role.PARAM), *graph.inputs[1:]))
    assert segments.cuts(graph, (0,)) == []
    assert segments.differentiate_segments(graph, (0,), (0,)) is None
    joint = differentiate(graph, (0,))
    assert _same(joint, differentiate(graph, (0,), whole=True))
