"""agoq under torch.compile: the custom operators and LAAQ's autograd functions trace without graph breaks, and
compiled steps give eager's loss and gradients (aot_eager: the same ops, so equal up to bf16 rounding; inductor:
its own fused kernels, so quantization codes may flip where a value sits at a rounding boundary)."""

import gc
import shutil

import pytest
import torch

import agoq
from agoq.runtime.activations.checkpointing import apply_checkpointing
from agoq.runtime.activations.compile import compile_decoder_layers
from agoq.models import build
from agoq.models.lm_loss import chunked_lm_loss

BATCH, SEQ = 2, 45  # non-round: the last quantization block of every tensor is partial
# chosen once: on a GPU machine the models, inputs and agoq's ops (triton_ops whose CUDA bodies torch.compile traces)
# run on the GPU; a CPU model there would test nothing of the CUDA path and mix devices with anything made on it
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def mixed_policy():
    """Quantized kinds at several widths, the three recomputable kinds recomputed, layer 1 left at 16 bits (and
    checkpointed by `make_model`)."""
    return agoq.ActivationPolicy(
        default={"norm_input": 4, "qkv_input": "recompute", "attention": 8, "o_proj_input": 6,
                 "ffn1_input": "recompute", "silu_input": 3, "ffn2_input": "recompute"},
        layers={1: {k: 16 for k in agoq.KINDS}})


POLICIES = {"bf16": lambda: "bf16", "agoq-paper": lambda: "agoq-paper", "int8": lambda: "int8",
            "int4": lambda: "int4", "mixed+checkpoint": mixed_policy,
            "nf4-stochastic": lambda: agoq.preset("int4", format="nf4", rounding="stochastic", block=64)}


def make_model(name, num_layers=2):
    model = build("llama-tiny", dtype=torch.bfloat16, num_layers=num_layers).to(DEVICE)
    agoq.apply_activation_policy(model, POLICIES[name]())
    if name == "mixed+checkpoint":
        apply_checkpointing(model, [1])
    return model


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, 256, (BATCH, SEQ), generator=g)
    labels[0, :7] = -100
    return ids.to(DEVICE), labels.to(DEVICE)


def step(fn, model, ids, labels):
    torch.manual_seed(7)  # stochastic rounding draws its seeds from the global generator, in call order
    loss = fn(ids, labels)
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def worst_rel_error(grads, ref):
    return max(((grads[n] - ref[n]).norm() / ref[n].norm().clamp(min=1e-12)).item() for n in ref)


def layer_inputs(model):
    x = torch.randn(BATCH, SEQ, model.config.hidden_size, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    cos, sin = model.model.rotary_emb(x, torch.arange(SEQ, device=DEVICE).unsqueeze(0))
    return x, cos, sin


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()  # drops the compiled code, and with it the tensors its guards and caches hold
    gc.collect()


@pytest.mark.parametrize("name", list(POLICIES))
def test_decoder_layer_has_no_graph_break(name):
    model = make_model(name)
    for layer in (model.model.layers[0], model.model.layers[1]):
        explained = torch._dynamo.explain(layer)(*layer_inputs(model))
        assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
        assert explained.graph_count == 1


def test_whole_model_with_chunked_loss_has_no_graph_break():
    model = make_model("agoq-paper")
    explained = torch._dynamo.explain(model)(*batch())
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]


@pytest.mark.parametrize("name", ["bf16", "agoq-paper", "int8", "int4", "mixed+checkpoint"])
def test_compiled_model_matches_eager(name):
    ids, labels = batch()
    eager = make_model(name)
    loss0, grads0 = step(eager, eager, ids, labels)
    model = make_model(name)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss1, grads1 = step(compiled, model, ids, labels)
    torch.testing.assert_close(loss1, loss0, rtol=4e-3, atol=0)
    assert worst_rel_error(grads1, grads0) < 1e-2
    model.zero_grad(set_to_none=True)  # a second step reuses the compiled graphs
    loss2, grads2 = step(compiled, model, ids, labels)
    if DEVICE == "cpu":
        assert torch.equal(loss2, loss1) and worst_rel_error(grads2, grads1) == 0
    else:  # GPU attention backward and reductions may sum in another order from one run to the next
        torch.testing.assert_close(loss2, loss1, rtol=1e-5, atol=0)
        assert worst_rel_error(grads2, grads1) < 1e-3


@pytest.mark.parametrize("name", ["mixed+checkpoint", "nf4-stochastic"])
def test_per_layer_compile_matches_eager(name):
    ids, labels = batch()
    eager = make_model(name)
    loss0, grads0 = step(eager, eager, ids, labels)
    model = make_model(name)
    assert compile_decoder_layers(model, backend="aot_eager") == 2
    loss1, grads1 = step(model, model, ids, labels)
    torch.testing.assert_close(loss1, loss0, rtol=4e-3, atol=0)
    assert worst_rel_error(grads1, grads0) < 1e-2


def test_chunked_lm_loss_compiled_equals_eager():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 37, 24, generator=g, dtype=torch.float64)
    weight = torch.randn(53, 24, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 53, (3, 37), generator=g)
    labels[1, ::3] = -100

    def loss_and_grads(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(h, w, labels)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    eager = loss_and_grads(lambda h, w, y: chunked_lm_loss(h, w, y, chunk_tokens=17))
    compiled = loss_and_grads(torch.compile(lambda h, w, y: chunked_lm_loss(h, w, y, chunk_tokens=17),
                                            backend="aot_eager", fullgraph=True))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    all_ignored = torch.full_like(labels, -100)
    out = torch.compile(lambda h, w, y: chunked_lm_loss(h, w, y), backend="aot_eager", fullgraph=True)(
        hidden, weight, all_ignored)
    assert torch.isnan(out)


@pytest.mark.skipif(DEVICE == "cpu" and shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_inductor_decoder_layer_matches_eager():
    """One agoq-paper decoder layer through Inductor (a cold CPU compile takes ~20 s, hence one layer, one policy).
    Inductor computes the pointwise ops between the agoq operators in float32 without bf16 roundings in
    between, so 4-bit codes can flip at rounding boundaries: the bound is the quantization error's scale."""
    model = make_model("agoq-paper", num_layers=1)
    layer = model.model.layers[0]
    x, cos, sin = layer_inputs(model)
    g = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(5)).to(DEVICE)

    def run(fn):
        layer.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_()
        out = fn(xi, cos, sin)
        out.backward(g)
        return [out.detach().float(), xi.grad.float()] + [p.grad.float() for p in layer.parameters()]

    eager = run(layer)
    compiled = run(torch.compile(layer, backend="inductor", fullgraph=True))
    for a, b in zip(compiled, eager):
        assert ((a - b).norm() / b.norm()).item() < 0.1


def test_train_compile_flag_compiles_each_layer_and_records_it(tmp_path, monkeypatch):
    import json

    import agoq.runtime.activations.compile as compile_module
    import agoq.train.apply as apply
    from agoq.cli import main

    calls = []
    real = compile_module.compile_decoder_layers

    def aot_eager_layers(model, **options):  # inductor's cold CPU compile would take most of a minute here
        calls.append(real(model, backend="aot_eager", **options))
        return calls[-1]

    monkeypatch.setattr(apply, "compile_decoder_layers", aot_eager_layers)  # where the trainer calls it
    out = tmp_path / "run"
    assert main(["train", "llama-tiny", "--policy", "agoq-paper", "--compile", "--seq-len", "24",
                 "--steps", "2", "--quiet", "--out", str(out)]) == 0
    run = json.loads((out / "run.json").read_text())
    assert calls == [3] and run["settings"]["compile"] is True and run["status"] == "finished"
    assert run["settings"]["compile_mode"] == "default"


def test_compile_mode_is_passed_on_and_cuda_graphs_are_refused_with_stochastic_rounding():
    model = make_model("nf4-stochastic")
    with pytest.raises(ValueError, match="stochastic"):
        compile_decoder_layers(model, mode="reduce-overhead", backend="aot_eager")
    with pytest.raises(ValueError, match="compile mode"):
        compile_decoder_layers(model, mode="fastest")
    seen = []
    for layer in model.model.layers:
        layer.compile = lambda **options: seen.append(options)
    assert compile_decoder_layers(model, mode="max-autotune-no-cudagraphs", backend="aot_eager") == 2
    assert seen == [{"backend": "aot_eager", "mode": "max-autotune-no-cudagraphs", "dynamic": False}] * 2
    seen.clear()
    compile_decoder_layers(model, mode="default", backend="aot_eager")
    assert seen == [{"backend": "aot_eager", "dynamic": False}] * 2


def test_layers_with_different_bit_widths_compile_with_constant_widths():
    """Layers share one forward; their widths differ. Dynamo must not turn a width into a symbolic int (agoq's
    Triton bodies need constants): every graph it builds gets only tensors as inputs, and each layer's compiled
    gradients equal eager's (same ops under aot_eager)."""
    widths = [(8, 4), (4, 8), (6, 5), (3, 4), (5, 7)]
    policy = agoq.ActivationPolicy(default={k: 8 for k in agoq.KINDS},
                                   layers={i: {"attention": a, "norm_input": n} for i, (a, n) in enumerate(widths)})
    models = []
    for _ in range(2):
        torch.manual_seed(3)
        model = build("llama-tiny", dtype=torch.bfloat16, num_layers=len(widths)).to(DEVICE)
        agoq.apply_activation_policy(model, policy)
        models.append(model)
    inputs_seen = []

    def backend(gm, example_inputs):
        inputs_seen.append([type(x).__name__ for x in example_inputs if not isinstance(x, torch.Tensor)])
        return gm.forward

    torch._dynamo.reset()
    assert compile_decoder_layers(models[1], backend=backend) == len(widths)
    ids, labels = batch()
    _, ref = step(models[0], models[0], ids, labels)
    _, got = step(models[1], models[1], ids, labels)
    assert len(inputs_seen) == len(widths) and all(not extra for extra in inputs_seen), inputs_seen
    assert worst_rel_error(got, ref) < 0.02
