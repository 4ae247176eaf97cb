"""Host offload of saved activations: a step with offloaded layers gives the loss and gradients of the same step
without offload, bit for bit (offload copies, it does not round), eager and compiled, bf16 and quantized; every
offloaded tensor comes back with its size, strides and dtype; the pool reuses its memory; bad layer lists are
refused."""

import gc

import pytest
import torch

import agoq
from agoq.runtime.activations.compile import compile_decoder_layers
from agoq.runtime.activations.offload import HostPool, apply_offload, parse_offload_layers, remove_offload
from agoq.models import build

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BATCH, SEQ = 2, 37


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    gc.collect()


def make_model(policy, layers=3):
    torch.manual_seed(11)
    model = build("llama-tiny", dtype=torch.bfloat16, num_layers=layers).to(DEVICE)
    if policy != "bf16":
        agoq.apply_activation_policy(model, policy)
    return model


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, 256, (BATCH, SEQ), generator=g)
    return ids.to(DEVICE), labels.to(DEVICE)


def train_steps(model, batches, offload=None):
    out = []
    for ids, labels in batches:
        if offload is not None:
            offload.begin_micro_batch()
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels)
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return out


def assert_same(got, ref):
    for (loss, grads), (loss0, grads0) in zip(got, ref, strict=True):
        assert torch.equal(loss, loss0)
        for name in grads0:
            assert torch.equal(grads[name], grads0[name]), name


@pytest.mark.parametrize("policy", ["bf16", "agoq-paper", "int8"])
def test_offloaded_steps_equal_kept_ones(policy):
    batches = [batch(s) for s in (1, 2, 3)]
    ref = train_steps(make_model(policy), batches)
    model = make_model(policy)
    offload = apply_offload(model, layers=[0, 2], min_bytes=0)
    got = train_steps(model, batches, offload)
    assert_same(got, ref)
    stats = offload.stats
    assert stats.offloaded_tensors > 0 and stats.fetched_on_demand >= 1
    assert set(stats.bytes_per_layer) == {0, 2}
    # every micro-batch offloads the same bytes, and the pool is reused: it holds one micro-batch's tensors
    assert stats.offloaded_bytes == 3 * sum(stats.bytes_per_layer.values())
    assert offload.pool.peak_used_bytes <= offload.pool.capacity_bytes
    assert offload.pool.peak_used_bytes < 2 * sum(stats.bytes_per_layer.values()) + 512 * stats.offloaded_tensors


def test_offload_keeps_what_compiled_backward_expects():
    """Compiled layers check the strides of what they saved (torch's own save_on_cpu loses them)."""
    batches = [batch(s) for s in (4, 5)]
    ref_model = make_model("agoq-paper")
    compile_decoder_layers(ref_model, backend="aot_eager")
    ref = train_steps(ref_model, batches)
    model = make_model("agoq-paper")
    compile_decoder_layers(model, backend="aot_eager")
    offload = apply_offload(model, layers=[0, 1, 2], min_bytes=0)
    assert_same(train_steps(model, batches, offload), ref)
    assert offload.stats.offloaded_tensors > 0


def test_offload_compiles_layers_whose_backward_uses_torch_func():
    """A compiled layer with quantized attention reruns its forward in backward by torch.func.vjp, which refuses to be
    traced while a saved-tensor hook is registered: its first call compiles without the hooks, and the steps still
    give the bits of the same compiled steps without offload."""
    batches = [batch(s) for s in (14, 15)]
    model = make_model("int4")  # compiled first: torch.compile's cache would otherwise hold the reference's graphs
    compile_decoder_layers(model, backend="aot_eager")
    offload = apply_offload(model, layers=[0, 2], min_bytes=0)
    got = train_steps(model, batches, offload)
    torch._dynamo.reset()
    ref_model = make_model("int4")
    compile_decoder_layers(ref_model, backend="aot_eager")
    assert_same(got, train_steps(ref_model, batches))
    assert offload.stats.offloaded_tensors > 0 and offload.stats.never_unpacked == 0


def test_quantized_layers_offload_their_codes():
    """Under a 4-bit policy a layer's saved activations are the packed codes: far fewer bytes than bf16's."""
    sizes = {}
    for policy in ("bf16", "int4"):
        model = make_model(policy)
        offload = apply_offload(model, layers=[1], min_bytes=0)
        train_steps(model, [batch(6)], offload)
        sizes[policy] = offload.stats.bytes_per_layer[1]
    assert sizes["int4"] < 0.5 * sizes["bf16"]


def test_parameters_and_shared_tables_stay():
    model = make_model("bf16")
    offload = apply_offload(model, layers=[0], min_bytes=0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = []
    pack = offload.pack

    def spy(layer, t):
        handle = pack(layer, t)
        seen.append((t.untyped_storage().data_ptr(), handle is t))
        return handle

    offload.pack = spy
    train_steps(model, [batch(7)], offload)
    kept = [as_is for ptr, as_is in seen if ptr in params]
    assert kept, "the layer saves its weights for backward: the spy should see them"
    assert all(kept)  # every parameter is handed back as it is, never offloaded
    assert 0 < offload.stats.offloaded_tensors == sum(not as_is for _, as_is in seen) < len(seen)


@pytest.mark.parametrize("shape,perm", [((5, 7, 3), (2, 0, 1)), ((6, 9), (1, 0))])
def test_tensors_come_back_with_their_layout(shape, perm):
    """Dense permuted tensors and strided slices, through the hooks and back."""
    model = make_model("bf16", layers=1)
    offload = apply_offload(model, layers=[0], min_bytes=0)
    g = torch.Generator().manual_seed(sum(shape))
    base = torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE)
    for t in (base.permute(*perm), base[..., ::2], base.transpose(0, -1)[1:]):
        handle = offload.pack(0, t)
        back = offload.unpack(handle)
        assert back.shape == t.shape and back.stride() == t.stride() and back.dtype == t.dtype
        assert torch.equal(back, t)
        assert torch.equal(offload.unpack(handle), t)  # asked again: from the host copy


def test_host_pool_reuses_and_respects_its_budget():
    pool = HostPool(pin=False, budget_bytes=3000, chunk_bytes=1024)
    a = pool.take(700)
    b = pool.take(300)  # 700 rounds up to 1024: a second chunk
    assert a.numel() == 700 and b.numel() == 300 and len(pool.chunks) == 2
    assert pool.take(2000) is None  # past the budget
    pool.reset()
    c = pool.take(1000)
    assert c.data_ptr() == a.data_ptr() and len(pool.chunks) == 2  # the same memory again
    with pytest.raises(ValueError, match="host budget"):
        HostPool(pin=False, budget_bytes=-1)


def test_budget_reached_keeps_tensors_on_the_device():
    batches = [batch(8)]
    ref = train_steps(make_model("bf16"), batches)
    model = make_model("bf16")
    offload = apply_offload(model, layers=[0, 1, 2], min_bytes=0, host_budget_bytes=4096)
    assert_same(train_steps(model, batches, offload), ref)
    assert offload.stats.kept_on_gpu_bytes > 0


def test_remove_offload_restores_the_calls():
    model = make_model("bf16")
    calls = [layer._compiled_call_impl for layer in model.model.layers]
    apply_offload(model, layers=[1])
    assert model.model.layers[1]._compiled_call_impl is not calls[1]
    remove_offload(model)
    assert [layer._compiled_call_impl for layer in model.model.layers] == calls
    assert apply_offload(model, layers=[]) is None


@pytest.mark.parametrize("text,layers", [("all", [0, 1, 2, 3]), ("all-but-last", [0, 1, 2]), ("none", []),
                                         ("0-1,3", [0, 1, 3]), (" 2 ", [2])])
def test_parse_offload_layers(text, layers):
    assert parse_offload_layers(text, 4) == layers


@pytest.mark.parametrize("text,match", [("0-9", "out of range"), ("x", "no layer index"), ("3-1", "no layer index")])
def test_parse_offload_layers_refuses(text, match):
    with pytest.raises(ValueError, match=match):
        parse_offload_layers(text, 4)
    with pytest.raises(ValueError, match="out of range"):
        apply_offload(make_model("bf16"), layers=[5])


def test_layers_above_start_the_prefetch():
    """Backward reaching layer 2 starts bringing back layer 0's tensors (the nearest offloaded below it), so none
    is fetched on demand; with the top layer offloaded, its own tensors are (nothing runs before it in backward)."""
    batches = [batch(9), batch(10)]
    ref = train_steps(make_model("int4"), batches)
    model = make_model("int4")
    offload = apply_offload(model, layers=[0], min_bytes=0)
    assert_same(train_steps(model, batches, offload), ref)
    assert offload.stats.fetched_on_demand == 0 and offload.stats.offloaded_tensors > 0
    model = make_model("int4")
    offload = apply_offload(model, layers=[0, 2], min_bytes=0)
    train_steps(model, batches, offload)
    assert offload.stats.fetched_on_demand == 2  # layer 2, once per micro-batch


@pytest.mark.skipif(DEVICE != "cuda", reason="prefetch depth follows the GPU's allocated bytes")
def test_backward_fetches_further_ahead_into_the_memory_it_freed():
    """Layers 0-2 offloaded under seven kept ones: by the time backward reaches layer 3, the kept layers above
    have freed more than layers 1 and 0 need, so they start early (fetched_ahead), nothing is fetched on demand,
    and the gradients are the same bits as without offload."""
    batches = [batch(12), batch(13)]
    ref = train_steps(make_model("bf16", layers=10), batches)
    model = make_model("bf16", layers=10)
    offload = apply_offload(model, layers=[0, 1, 2], min_bytes=0)
    assert_same(train_steps(model, batches, offload), ref)
    assert offload.stats.fetched_on_demand == 0
    assert offload.stats.fetched_ahead >= 2 * len(batches) - 1


def test_no_fetch_ahead_while_a_checkpointed_layer_is_still_to_rerun():
    """Which offloaded layers backward brings back early at each layer, on random layouts (offloaded prefix,
    checkpointed layers anywhere, some offloaded too, as full checkpointing with its inputs offloaded), against a
    walk written out here: none while a checkpointed layer from the current one down to the nearest offloaded one is
    still to run; else the ones below the nearest, nearest first, each not yet on its way and within the room left."""
    import random

    from agoq.runtime.activations.offload import ActivationOffload

    rng = random.Random()
    seed = rng.getrandbits(32)
    rng.seed(seed)
    offload = ActivationOffload(torch.nn.Linear(3, 5), device="cpu")
    for trial in range(300):
        L = rng.randint(2, 13)
        k = rng.randint(1, L)
        offload._layer_order = list(range(k))
        offload._layer_bytes = {i: rng.randint(1, 9) * 1000 + rng.randint(0, 999) for i in range(k)}
        offload._fetched = {i for i in range(k) if rng.random() < 0.2}
        offload.checkpointed = {i for i in range(L) if rng.random() < 0.3}
        index, room = rng.randint(1, L - 1), rng.randint(0, 40000)
        below = [i for i in range(k - 1, -1, -1) if i < index]
        blocked = any(below and below[0] <= j <= index for j in offload.checkpointed)
        expected, left = [], room
        if not blocked:
            for layer in below[1:]:
                if layer in offload._fetched:
                    continue
                if offload._layer_bytes[layer] > left:
                    break
                expected.append(layer)
                left -= offload._layer_bytes[layer]
        assert offload.ahead(index, room) == expected, f"seed {seed} trial {trial}"


@pytest.mark.skipif(DEVICE != "cuda", reason="prefetch depth follows the GPU's allocated bytes")
def test_checkpointed_layers_between_hold_back_the_fetch_ahead():
    """Layers 0-2 offloaded, 3-4 checkpointed, five kept above: backward brings back only the nearest offloaded
    layer until it has rerun layers 4 and 3, so at most one layer per micro-batch is fetched ahead (at layer 2);
    the gradients are the same bits as the same checkpointing without offload."""
    from agoq.runtime.activations.checkpointing import apply_checkpointing

    batches = [batch(14), batch(15)]
    model = make_model("bf16", layers=10)
    apply_checkpointing(model, layers=[3, 4])
    ref = train_steps(model, batches)
    model = make_model("bf16", layers=10)
    apply_checkpointing(model, layers=[3, 4])
    offload = apply_offload(model, layers=[0, 1, 2], min_bytes=0)
    assert offload.checkpointed == {3, 4}
    assert_same(train_steps(model, batches, offload), ref)
    assert offload.stats.fetched_ahead <= len(batches)


def test_a_new_micro_batch_lets_go_of_tensors_backward_never_asked_for():
    """Autograd can save a tensor its backward never reads: the next micro-batch still empties the pool (else it
    would grow every step) and counts it."""
    model = make_model("bf16", layers=1)
    offload = apply_offload(model, layers=[0], min_bytes=0)
    g = torch.Generator().manual_seed(12)
    a, b = (torch.randn(33, 17, generator=g).to(DEVICE) for _ in range(2))
    used, kept = offload.pack(0, a), offload.pack(0, b)
    assert torch.equal(offload.unpack(used), a)
    first = offload.pool.used_bytes
    offload.begin_micro_batch()
    assert offload.stats.never_unpacked == 1 and offload.pool.used_bytes == 0 and not offload._entries
    again = offload.pack(0, b)
    assert offload.pool.used_bytes < first and torch.equal(offload.unpack(again), b)
    assert len(offload.pool.chunks) == 1
