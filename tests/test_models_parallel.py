"""The split model (labkit.models.parallel) against the unsplit one.

Fast tests run the ranks as threads of this process, joined by an in-memory stand-in for
torch.distributed (the same three calls), on a tiny random Llama; the slow tests launch
SmolLM2 through torchrun with gloo and compare with the library's own greedy loop."""

import queue
import threading

import pytest
import torch

from conftest import assert_greedy_near, make_tiny_llama
from labkit.engine.loop import greedy_decode
from labkit.models.parallel import (DictReader, PipelineShard, TensorShard, even_split,
                                    pipeline_generate, planned_weight_bytes, pipeline_stage, tensor_parallel_generate,
                                    tensor_parallel_model, tensor_shard_state, weight_bytes)


def hf_state(model) -> dict:
    """The Hugging Face-named state dict a Llama was built from (q/k/v and gate/up unfused)."""
    c = model.config
    state = {"model.embed_tokens.weight": model.embed.detach().clone(),
             "model.norm.weight": model.final_norm.detach().clone()}
    widths = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.qkv.detach().split(widths)
        gate, up = layer.gate_up.detach().chunk(2)
        state.update({p + "input_layernorm.weight": layer.attn_norm.detach(),
                      p + "post_attention_layernorm.weight": layer.mlp_norm.detach(),
                      p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                      p + "self_attn.v_proj.weight": v,
                      p + "self_attn.o_proj.weight": layer.o_proj.detach(),
                      p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                      p + "mlp.down_proj.weight": layer.down.detach()})
    return state


class ThreadGroup:
    """`world` ranks as threads: all_reduce sums every rank's tensor (in rank order), send and
    recv go through one queue per (source, destination) pair."""

    def __init__(self, world):
        self.world, self.barrier = world, threading.Barrier(world, timeout=60)
        self.slots = [None] * world
        self.queues = {(s, d): queue.Queue() for s in range(world) for d in range(world)}

    def comm(self, rank):
        group = self

        class Comm:
            def __init__(self):
                self.rank, self.world = rank, group.world

            def all_reduce(self, t):
                group.slots[rank] = t.clone()
                group.barrier.wait()
                total = sum(group.slots[1:], group.slots[0].clone())
                group.barrier.wait()
                return t.copy_(total)

            def send(self, t, dst):
                group.queues[(rank, dst)].put(t.clone())

            def recv(self, t, src):
                t.copy_(group.queues[(src, rank)].get(timeout=60))

        return Comm()

    def run(self, fn):
        """fn(comm) on every rank at once; the results in rank order."""
        results, errors = [None] * self.world, []

        def body(rank):
            try:
                results[rank] = fn(self.comm(rank))
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


@pytest.fixture(scope="module")
def tiny():
    # 6 query heads in 3 KV groups and 5 layers: degree 2 splits both unevenly
    return make_tiny_llama(seed=1, hidden=48, heads=6, kv_heads=3, layers=5)


PROMPT = [5, 17, 3, 88, 41, 9, 60]


def test_even_split():
    assert even_split(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert even_split(3, 2) == [(0, 2), (2, 3)]
    assert even_split(1536, 3) == [(0, 512), (512, 1024), (1024, 1536)]
    with pytest.raises(ValueError):
        even_split(3, 4)


def test_tensor_degree_above_kv_heads_is_refused(tiny):
    with pytest.raises(ValueError, match="KV heads"):
        TensorShard.plan(tiny.config, 0, 4)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_tensor_shards_concatenate_to_the_full_weights(tiny, world):
    c, full = tiny.config, hf_state(tiny)
    shards = [tensor_shard_state(DictReader(full), c, TensorShard.plan(c, r, world))
              for r in range(world)]
    for name, tensor in full.items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                          "up_proj.weight")):
            joined = torch.cat([s[name] for s in shards], dim=0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            joined = torch.cat([s[name] for s in shards], dim=1)
        else:  # norms and the embedding: every rank holds them whole
            assert all(torch.equal(s[name], tensor) for s in shards)
            continue
        assert torch.equal(joined, tensor), name
        assert all(s[name].numel() < tensor.numel() for s in shards) or world == 1


def test_smollm2_shards_split_heads_by_kv_group():
    from labkit.models.loader import ensure_dequantized

    _, config, _ = ensure_dequantized("smollm2-135m")
    shards = [TensorShard.plan(config, r, 3) for r in range(3)]
    assert [s.heads(config) for s in shards] == [(0, 3), (3, 6), (6, 9)]
    assert [s.intermediate for s in shards] == [(0, 512), (512, 1024), (1024, 1536)]
    assert [TensorShard.plan(config, r, 2).kv_heads for r in range(2)] == [(0, 2), (2, 3)]
    assert [PipelineShard.plan(config, r, 4).layers for r in range(4)] == [
        (0, 8), (8, 16), (16, 23), (23, 30)]


# The logit error each split may add to the full model's: a tensor-parallel layer sums its
# shards' partial products in another order (1e-4); a pipeline runs the same layers on the same
# rows, stage after stage (1e-5). The greedy tokens agree up to the near-tie rule (twice it).
TP_LOGIT_ERROR, PIPELINE_LOGIT_ERROR = 1e-4, 1e-5


def _reference(model, steps):
    run = greedy_decode(model, PROMPT, steps, keep_logits=True)
    return run.token_ids, torch.stack(run.logits)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_tensor_parallel_matches_the_full_model(tiny, world):
    tokens, logits = _reference(tiny, 8)
    state = hf_state(tiny)
    runs = ThreadGroup(world).run(lambda comm: tensor_parallel_generate(
        tensor_parallel_model(DictReader(state), tiny.config, comm), PROMPT, 8))
    for run in runs:  # every rank computes the full logits
        # fp32 sums in another order: the logits within 1e-4 on the steps both share, the tokens
        # equal up to the near-tie rule
        assert_greedy_near([tokens], [run.tokens], [logits], TP_LOGIT_ERROR, [run.logits],
                           what=f"tensor parallel over {world} against the full model")
        assert len(run.step_seconds) == 7


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_pipeline_matches_the_full_model(tiny, world):
    tokens, logits = _reference(tiny, 8)
    state = hf_state(tiny)
    runs = ThreadGroup(world).run(lambda comm: pipeline_generate(
        pipeline_stage(DictReader(state), tiny.config, comm), comm, PROMPT, 8))
    assert runs[0].tokens == runs[-1].tokens  # the last stage's tokens, sent back: exact
    assert_greedy_near([tokens], [runs[-1].tokens], [logits], PIPELINE_LOGIT_ERROR, [runs[-1].logits],
                       what=f"a pipeline of {world} against the full model")
    assert all(r.tokens == [] and r.logits is None for r in runs[1:-1])


def test_each_rank_holds_only_its_shard(tiny):
    state, c = hf_state(tiny), tiny.config
    full = weight_bytes(tiny)
    embed = tiny.embed.nbytes
    tp = ThreadGroup(3).run(lambda comm: weight_bytes(
        tensor_parallel_model(DictReader(state), c, comm)))
    # the matrices split three ways; embedding (tied head) and every norm on every rank
    norms = sum(layer.attn_norm.nbytes + layer.mlp_norm.nbytes for layer in tiny.layers)
    replicated = embed + tiny.final_norm.nbytes + norms
    assert sum(tp) - 2 * replicated == full
    pp = ThreadGroup(2).run(lambda comm: weight_bytes(pipeline_stage(DictReader(state), c, comm)))
    # pipeline: the last rank keeps its own copy of the tied embedding as the LM head
    assert sum(pp) == full + embed


@pytest.mark.parametrize("mode, world", [("tensor", 1), ("tensor", 2), ("tensor", 3),
                                         ("pipeline", 1), ("pipeline", 2), ("pipeline", 5)])
def test_planned_bytes_are_what_the_built_shards_hold(tiny, mode, world):
    state, c = hf_state(tiny), tiny.config
    build = {"tensor": lambda comm: tensor_parallel_model(DictReader(state), c, comm),
             "pipeline": lambda comm: pipeline_stage(DictReader(state), c, comm)}[mode]
    held = ThreadGroup(world).run(lambda comm: weight_bytes(build(comm)))
    assert planned_weight_bytes(c, mode, world) == held


def test_last_stage_head_is_the_tied_embedding(tiny):
    state = hf_state(tiny)
    first, last = ThreadGroup(2).run(lambda comm: pipeline_stage(DictReader(state), tiny.config, comm))
    assert torch.equal(last.lm_head, tiny.embed) and last.embed is None
    assert first.lm_head is None and torch.equal(first.embed, tiny.embed)


# -- real processes: SmolLM2 under torchrun with gloo ------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mode, procs", [("tensor", 3), ("pipeline", 2), ("tensor", 1),
                                         ("pipeline", 1)])
def test_torchrun_split_model_matches_library(model, mode, procs, tmp_path):
    from labkit.experiments.distributed import run_generation

    prompt = model.tokenizer.encode("An inference engine takes a trained model and")
    reference = greedy_decode(model, prompt, 6, keep_logits=True)
    run = run_generation(mode, procs, prompt, 6, workdir=tmp_path)
    assert run.procs == procs and run.backend == "gloo" and run.ranks_agree
    assert_greedy_near([reference.token_ids], [run.tokens], [torch.stack(reference.logits)], TP_LOGIT_ERROR,  # either mode
                       [run.logits],
                       what=f"{mode} over {procs} processes against the library")
    inside = run.ranks[0]["step_comm_s"]  # communication time within each decode step
    assert len(inside) == len(run.step_seconds) == 5
    assert all(0 <= c <= s for c, s in zip(inside, run.step_seconds))
    assert (max(inside) > 0) == (procs > 1)
    if mode == "tensor" and procs > 1:  # two all-reduces per layer per step, hidden-sized
        steps, layers = 6, model.config.num_layers
        counts = run.comm_totals(0)["all_reduce"]
        assert counts["calls"] == 2 * layers * steps
        hidden_bytes = model.config.hidden_size * 4
        assert counts["bytes"] == 2 * layers * hidden_bytes * (len(prompt) + steps - 1)
    if mode == "pipeline" and procs > 1:
        assert run.comm_totals(0)["send"]["calls"] == 6
        assert run.comm_totals(procs - 1)["send"]["calls"] == 6  # the tokens coming back
