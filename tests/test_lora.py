"""Multi-LoRA serving (docs/lora.md) on a tiny random Llama, CPU float32:
three PEFT adapters of ranks 8, 16 and 64 (random, non-zero B, so each
changes the output) against HF transformers + peft, in batches that mix all
three and the base model, with radix cache hits; the cache never serves a
prefix across adapters; fewer slots than adapters; tensor parallelism; bad
flags and adapter names; one HTTP server; adapters loaded and unloaded
while serving (the Engine and the HTTP endpoints)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import radixserve
from radixserve.lora.options import parse_lora_paths, parse_target_modules
from radixserve.lora.slots import LoRASlotTable
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.server_args import ServerArgs

peft = pytest.importorskip("peft")

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1)
# name: (rank, alpha, rsLoRA, target modules)
ADAPTERS = {
    "a8": (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "a16": (16, 8, True, ["q_proj", "v_proj", "down_proj"]),
    "a64": (64, 32, False, ["k_proj", "o_proj", "gate_proj", "up_proj"]),
}
N_NEW = 10
GREEDY = {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(base model folder, {adapter name: folder}, the reference's greedy tokens)."""
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, architectures=["LlamaForCausalLM"])
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    base.save_pretrained(root / "base")
    folders = {}
    for i, (name, (r, alpha, rslora, modules)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        model = peft.get_peft_model(_base(root), peft.LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora,
                                                                  target_modules=modules, lora_dropout=0.0))
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if "lora_B" in pname:
                    param.normal_(0, 0.3)  # PEFT starts B at zero: the adapter would change nothing
        model.save_pretrained(root / name)
        folders[name] = str(root / name)
    return str(root / "base"), folders


def _base(root):
    model = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


_REFERENCE: dict = {}


@torch.no_grad()
def reference(models, adapter: str | None, ids: list[int], n: int = N_NEW) -> list[int]:
    """HF's greedy tokens for ``ids`` under ``adapter`` (peft, fp32)."""
    base_dir, folders = models
    key = (adapter, tuple(ids), n)
    if key not in _REFERENCE:
        if (adapter, "model") not in _REFERENCE:
            model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None
            if adapter is not None:
                model = peft.PeftModel.from_pretrained(model, folders[adapter]).eval()
            _REFERENCE[(adapter, "model")] = model
        model = _REFERENCE[(adapter, "model")]
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        _REFERENCE[key] = out[0, len(ids):].tolist()
    return _REFERENCE[key]


def engine(models, **kw):
    base_dir, folders = models
    kw.setdefault("lora_paths", [f"{name}={path}" for name, path in folders.items()])
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("max_running_requests", 16)
    return radixserve.Engine(model_path=base_dir, device="cpu", check_invariants=True, disable_tqdm=True,
                             enable_lora=True, **kw)


def prompts(n: int, length: int = 12, seed: int = 0, shared: tuple = ()) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [list(shared) + torch.randint(0, 320, (length + i,), generator=gen).tolist() for i in range(n)]


STACKED_SCRIPT = r"""
import copy, json, sys
import torch
from torch import nn
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.lora.manager import LoRAManager
from radixserve.lora.options import LoRAOptions

folders = json.loads(sys.argv[1])
H, I = 64, 96


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj, self.o_proj = QKVParallelLinear(H, 16, 4, 2), RowParallelLinear(H, H)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj, self.down_proj = MergedColumnParallelLinear(H, [I, I]), RowParallelLinear(I, H)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = Attn(), Mlp()


torch.manual_seed(0)
base = nn.Module()
base.layers = nn.ModuleList([Layer(), Layer()])
for p in base.parameters():
    p.data.normal_(0, 0.1)
weights = {n: p.detach().clone() for n, p in base.named_parameters()}
models = {b: copy.deepcopy(base) for b in ("triton", "torch_native")}
managers = {b: LoRAManager(m, 2, LoRAOptions(paths=folders, max_loras_per_batch=2, backend=b), 0, torch.float32,
                           torch.device("cpu")) for b, m in models.items()}
stacked = managers["triton"].layers
report = {"stacked": sum(layer.stacked for layer in stacked), "plain": sum(layer.stacked for layer in managers["torch_native"].layers),
          "pool": [managers[b].pool.shape[1] for b in managers],
          "weights kept": all(torch.equal(p, weights[n]) for n, p in models["triton"].named_parameters()),
          "views": all(layer.stacked_weight.data_ptr() == m.weight.data_ptr() for layer, m in
                       zip(stacked, (mod for name, mod in models["triton"].named_modules() if name.endswith("_proj"))))}
act = SiluAndMul()
# (adapter, slot, tokens) per request; the second batch puts a16 in slot 0 in place of a8
batches = [[("a8", 0, 3), (None, -1, 2), ("a64", 1, 4), ("a8", 0, 1)], [("a16", 0, 2), ("a64", 1, 3), (None, -1, 1)],
           [(None, -1, 3)]]
errors = []
for i, reqs in enumerate(batches):
    rows = sum(n for _, _, n in reqs)
    outs = {}
    for b, manager in managers.items():
        uids = [None if a is None else manager.resolve(a) for a, _, _ in reqs]
        manager.activate(manager.prepare(uids, [s for _, s, _ in reqs], [n for _, _, n in reqs]))
        gen = torch.Generator().manual_seed(i)
        outs[b] = []
        for layer in models[b].layers:
            attn, mlp = layer.self_attn, layer.mlp
            outs[b] += [attn.qkv_proj(torch.randn(rows, H, generator=gen)), attn.o_proj(torch.randn(rows, H, generator=gen)),
                        mlp.gate_up_proj.forward_gated(torch.randn(rows, H, generator=gen), act),
                        mlp.down_proj(torch.randn(rows, I, generator=gen))]
    errors.append(max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(outs["triton"], outs["torch_native"])))
report["errors"] = errors
report["contiguous"] = [bool(o.is_contiguous()) for o in outs["triton"][:4]]
print(json.dumps(report))
"""


def test_stacked_layers_equal_the_torch_path_through_slot_refills(models):
    """The triton backend's stacked layers (each slot's A under the base
    weight: the shrink is the base GEMM's; pool.LoRALayer.stack) against
    the torch path, layer by layer, in Triton's interpreter: batches mixing
    adapters and rows without one, a slot refilled with another adapter,
    and a batch with no adapter. The base weights keep their values and
    shapes (views of the stacked ones), the pool holds no A, and the
    row-parallel layers' outputs are contiguous."""
    from triton_interpreter import run_interpreted

    report = run_interpreted(STACKED_SCRIPT, models[1])
    assert report["stacked"] == 8 and report["plain"] == 0
    assert report["weights kept"] and report["views"]
    assert report["pool"][0] < report["pool"][1], "the stacked layers' A are still in the pool"
    assert all(e < 1e-5 for e in report["errors"]), report["errors"]
    assert report["contiguous"][1] and report["contiguous"][3], "o_proj and down_proj must give contiguous outputs"


MIX = ["a8", None, "a16", "a64", "a8", "a64", None, "a16"]  # interleaved: no adapter's rows are contiguous


def test_one_batch_mixing_three_adapters_and_the_base_matches_hf_peft_with_radix_hits(models):
    batch = prompts(len(MIX))
    expected = [reference(models, a, ids) for a, ids in zip(MIX, batch)]
    assert all(expected[i] != reference(models, None, batch[i]) for i, a in enumerate(MIX) if a is not None), \
        "each adapter changes the output"
    with engine(models) as eng:
        first = eng.generate(input_ids=batch, sampling_params=GREEDY, lora_path=MIX)
        assert [o["output_ids"] for o in first] == expected
        again = eng.generate(input_ids=batch, sampling_params=GREEDY, lora_path=MIX)  # every prompt cached
        assert [o["output_ids"] for o in again] == expected
        assert all(o["meta_info"]["cached_tokens"] >= len(ids) - 1 for o, ids in zip(again, batch))


def test_fewer_slots_than_adapters_still_serves_every_request_exactly(models):
    """Two slots for three adapters: requests whose adapter finds no slot wait
    (the base model's go on), and slots are refilled as adapters leave."""
    batch = prompts(len(MIX), seed=1)
    with engine(models, max_loras_per_batch=2) as eng:
        outs = eng.generate(input_ids=batch, sampling_params=GREEDY, lora_path=MIX)
        assert [o["output_ids"] for o in outs] == [reference(models, a, ids) for a, ids in zip(MIX, batch)]
        slots = eng.scheduler.lora_slots
        assert slots.num_slots == 2 and eng.scheduler.model_runner.lora_manager.slot_uids == slots.owners


def test_the_cache_never_serves_a_prefix_across_adapters(models):
    """The same prompt under the base model, then each adapter: no hit from
    another adapter's (or the base's) KV, and the tokens are each adapter's
    own (KV reused across adapters would change them); then hits within one."""
    ids = prompts(1, length=40, seed=2)[0]
    with engine(models) as eng:
        for adapter in (None, "a8", "a16", "a64"):
            out = eng.generate(input_ids=ids, sampling_params=GREEDY, lora_path=adapter)
            assert out["meta_info"]["cached_tokens"] == 0, f"{adapter} found another adapter's prefix"
            assert out["output_ids"] == reference(models, adapter, ids)
        for adapter in ("a64", None):
            out = eng.generate(input_ids=ids + [5, 6], sampling_params=GREEDY, lora_path=adapter)
            assert out["meta_info"]["cached_tokens"] >= len(ids)
            assert out["output_ids"] == reference(models, adapter, ids + [5, 6])


def test_radix_cache_namespaces_are_separate_trees():
    cache = RadixCache(None, _Allocator(), page_size=2)
    key = list(range(10))
    assert cache.insert(key, torch.arange(10), "a#1") == 0
    assert len(cache.match_prefix(key).device_indices) == 0
    assert len(cache.match_prefix(key, "b#2").device_indices) == 0
    assert cache.insert(key, torch.arange(10, 20)) == 0  # the base model's own copy
    assert cache.match_prefix(key[:6], "a#1").device_indices.tolist() == list(range(6))  # splits inside "a#1"
    assert cache.match_prefix(key).device_indices.tolist() == list(range(10, 20))
    assert cache.insert(key[:4] + [99, 98], torch.arange(30, 36), "a#1") == 4
    cache.check_invariants()
    assert cache.evict(100) == 22 and cache.total_size() == 0
    cache.check_invariants()


class _Allocator:
    def free(self, slots):
        pass

    def free_group_begin(self):
        pass

    def free_group_end(self):
        pass


def test_slot_table_never_takes_a_slot_an_adapter_in_use_holds():
    table = LoRASlotTable(2)
    assert table.assign(["x", None, "x"], in_use=set()) == [0, -1, 0]
    assert table.assign(["y"], in_use={"x"}) == [1]
    assert not table.fits("z", {"x", "y"}) and table.fits("x", {"x", "y"}) and table.fits(None, {"x", "y"})
    assert table.fits("z", {"y"})
    assert table.assign(["z"], in_use={"y"}) == [0]  # x's slot, though y's was used last
    with pytest.raises(RuntimeError, match="admission let too many in"):
        table.assign(["w"], in_use={"y", "z"})


def test_bad_adapter_names_and_flags_are_refused_by_name(models, tmp_path):
    base_dir, folders = models
    with engine(models, lora_paths=[f"a8={folders['a8']}"]) as eng:
        with pytest.raises(ValueError, match="lora_path: unknown LoRA adapter 'nope' \\(loaded: a8\\)"):
            eng.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, lora_path="nope")
        with pytest.raises(ValueError, match="lora_path: 1 given for 2 prompts"):
            eng.generate(input_ids=[[1, 2], [3, 4]], sampling_params=GREEDY, lora_path=["a8"])
    with radixserve.Engine(model_path=base_dir, device="cpu", disable_tqdm=True) as eng:
        with pytest.raises(ValueError, match="lora_path: .*--enable-lora"):
            eng.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, lora_path="a8")
    with pytest.raises(ValueError, match="lora_paths: adapter 'a64' has rank 64, above --max-lora-rank 16"):
        engine(models, max_lora_rank=16)
    with pytest.raises(ValueError, match="lora_paths: adapter 'a8' targets .*not among --lora-target-modules"):
        engine(models, lora_target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="is not a PEFT LoRA adapter folder"):
        engine(models, lora_paths=[f"x={tmp_path}"])
    for kwargs, message in [
        (dict(enable_lora=True, max_loras_per_batch=0, lora_paths=["a=/x"]), "max_loras_per_batch must be >= 1"),
        (dict(enable_lora=True), "without --lora-paths, give --max-lora-rank and --lora-target-modules"),
        (dict(max_lora_rank=8), "max_lora_rank: needs --enable-lora"),
        (dict(lora_paths=["a=/x"], lora_target_modules=["embed_tokens"]),
         "lora_target_modules: 'embed_tokens' is not supported"),
        (dict(lora_paths=["a=/x", "a=/y"]), "lora_paths: the name 'a' is given twice"),
        (dict(lora_paths=["a:b=/x"]), "lora_paths: 'a:b' is not a usable adapter name"),
        (dict(lora_paths=["a=/x"], max_loaded_loras=2), "max_loaded_loras must be at least --max-loras-per-batch"),
        (dict(lora_paths=["a=/x"], enable_hierarchical_cache=True), "enable_lora: not with --enable-hierarchical"),
        (dict(lora_paths=["a=/x"], disaggregation_mode="prefill"), "enable_lora: not with --disaggregation-mode"),
        (dict(lora_paths=["a=/x"], kv_events_config='{"publisher": "zmq"}'), "enable_lora: not with --kv-events"),
        (dict(lora_paths=["a=/x"], lora_backend="csgmv"), "lora_backend must be one of triton, torch_native"),
        (dict(lora_paths=["a=/x"], lora_backend="triton", device="cpu"), "lora_backend: triton runs on CUDA only"),
        (dict(lora_backend="triton"), "lora_backend: needs --enable-lora"),
    ]:
        with pytest.raises(ValueError, match=message):
            ServerArgs(**kwargs)


def test_lora_paths_take_sglang_forms_and_the_torch_backend_turns_cuda_graphs_off():
    entries = ["a=/p/one", "/p/two/", json.dumps({"lora_name": "c", "lora_path": "/p/three", "pinned": False})]
    assert parse_lora_paths(entries) == {"a": "/p/one", "two": "/p/two/", "c": "/p/three"}
    assert parse_target_modules(["all"]) == frozenset(ADAPTERS["a8"][3])
    args = ServerArgs(lora_paths="a=/p/one", device="cpu")  # the CPU's backend: torch_native
    assert args.lora_options().backend == "torch_native"
    assert args.enable_lora and args.disable_cuda_graph and args.resolved_cuda_graph_max_bs() == 0
    assert args.resolved_piecewise_cuda_graph_tokens() == []
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    cli = ServerArgs.from_cli_args(parser.parse_args(
        ["--enable-lora", "--lora-paths", "a=/p/one", "/p/two", "--max-loras-per-batch", "2",
         "--lora-target-modules", "q_proj", "v_proj", "--max-lora-rank", "32"]))
    options = cli.lora_options()
    assert options.paths == {"a": "/p/one", "two": "/p/two"} and options.max_loras_per_batch == 2
    assert options.target_modules == {"q_proj", "v_proj"} and options.max_lora_rank == 32


def test_tp2_serves_the_mixed_batch_with_the_same_tokens(models):
    """A and B split as the base layers are (column-parallel: B by output;
    row-parallel: A by input); the fused q/k/v and gate/up too."""
    batch = prompts(len(MIX), seed=3)
    with engine(models, tp_size=2, dist_timeout=60) as eng:
        outs = eng.generate(input_ids=batch, sampling_params=GREEDY, lora_path=MIX)
    assert [o["output_ids"] for o in outs] == [reference(models, a, ids) for a, ids in zip(MIX, batch)]


@pytest.fixture(scope="module", autouse=True)
def lora_servers(request, models):
    """The HTTP servers of the tests below that the selected tests use,
    started one after another in the background with the module's first
    test (they load while the tests before run): ``serving`` (two adapters
    at start-up) and ``loading`` (one, and room for rank 64 on every module)."""
    from server_harness import ONE_THREAD, Prestarted, selected

    base_dir, folders = models
    base = ("--model-path", base_dir, "--device", "cpu", "--max-total-tokens", "4096", "--enable-lora")
    specs = {"serving": (*base, "--lora-paths", f"a8={folders['a8']}", folders["a16"]),
             "loading": (*base, "--lora-paths", f"a16={folders['a16']}", "--max-lora-rank", "64",
                         "--lora-target-modules", "all")}
    started = Prestarted({name: (args, {"env": ONE_THREAD}) for name, args in specs.items()
                          if selected(request, f"{name}_server")})
    yield started
    started.stop()


@pytest.fixture
def serving_server(lora_servers):
    return lora_servers.get("serving")


@pytest.fixture
def loading_server(lora_servers):
    return lora_servers.get("loading")


def test_http_server_serves_adapters_by_lora_path_and_by_openai_model_name(models, serving_server):
    srv = serving_server
    try:
        batch = prompts(2, seed=4)
        r = httpx.post(srv.url + "/generate", json={"input_ids": batch, "sampling_params": GREEDY,
                                                    "lora_path": ["a16", None]}, timeout=60)
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == [reference(models, "a16", batch[0]),
                                                       reference(models, None, batch[1])]
        r = httpx.post(srv.url + "/generate", json={"input_ids": batch[0], "lora_path": "nope"}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "lora_path" and "'nope' (loaded: a16, a8)" in err["message"]

        # the model has no tokenizer (no text): the greedy tokens' logprobs tell the adapters apart
        body = {"prompt": batch[0], "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        logprobs = {}
        for model in ("base:a8", "a8", "base"):
            r = httpx.post(srv.url + "/v1/completions", json={**body, "model": model}, timeout=60)
            assert r.status_code == 200, r.text
            logprobs[model] = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        native = httpx.post(srv.url + "/generate", json={"input_ids": batch[0], "sampling_params": GREEDY,
                                                         "lora_path": "a8", "return_logprob": True}, timeout=60)
        logprobs["native"] = [lp[0] for lp in native.json()["meta_info"]["output_token_logprobs"]]
        assert logprobs["a8"] == pytest.approx(logprobs["base:a8"], abs=1e-4)
        assert logprobs["a8"] == pytest.approx(logprobs["native"], abs=1e-4)
        assert logprobs["a8"] != pytest.approx(logprobs["base"], abs=1e-2)
        r = httpx.post(srv.url + "/v1/completions", json={**body, "model": "base:nope"}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "model" and "'nope', which is not loaded" in err["message"]
        cards = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("base", None), ("a16", "base"), ("a8", "base")]
        assert srv.wait_idle()["memory_check"] == "ok"
    finally:
        assert srv.stop() == 0


# -- loading and unloading while serving ---------------------------------------------------
def test_load_use_unload_while_running_then_reload_the_name_with_other_weights(models):
    """An adapter loaded at run time serves HF + peft's tokens; unloaded while
    a request of it runs, new requests naming it are refused at once, the
    running one ends with its own tokens, and only then are its slot and host
    copy freed; loaded again under the name with other weights, it gets a new
    uid: none of the old load's cached KV is served and the tokens are the new
    weights'."""
    _, folders = models
    ids = prompts(1, length=30, seed=5)[0]
    with engine(models) as eng:
        manager, slots, cache = eng.scheduler.model_runner.lora_manager, eng.scheduler.lora_slots, eng.scheduler.tree_cache
        out = eng.load_lora_adapter("x", folders["a8"], pinned=False)
        assert out == {"success": True, "error_message": "", "loaded_adapters": {**folders, "x": folders["a8"]}}
        assert eng.generate(input_ids=ids, sampling_params=GREEDY, lora_path="x")["output_ids"] == \
            reference(models, "a8", ids)
        old_uid = manager.adapters["x"].uid

        stream = eng.generate(input_ids=ids + [7], sampling_params=GREEDY, lora_path="x", stream=True)
        assert next(stream)["meta_info"]["cached_tokens"] >= len(ids) - 1  # running, on the first load's KV
        assert eng.unload_lora_adapter("x")["loaded_adapters"] == folders
        with pytest.raises(ValueError, match="lora_path: unknown LoRA adapter 'x' \\(loaded: a16, a64, a8\\)"):
            eng.generate(input_ids=ids, sampling_params=GREEDY, lora_path="x")
        assert old_uid in manager.unloading and old_uid in slots.owners  # still in use: not freed yet
        *_, last = stream
        assert last["output_ids"] == reference(models, "a8", ids + [7])
        assert not manager.unloading and old_uid not in slots.owners and manager.slot_uids == slots.owners

        eng.load_lora_adapter("x", folders["a64"])  # the same name, other weights (and rank)
        assert manager.adapters["x"].uid != old_uid
        again = eng.generate(input_ids=ids + [7], sampling_params=GREEDY, lora_path="x")
        assert again["meta_info"]["cached_tokens"] == 0, "served KV computed under the unloaded weights"
        assert again["output_ids"] == reference(models, "a64", ids + [7])
        eng.scheduler.check_memory()
        cache.evict(cache.total_size())  # the unloaded load's KV goes as any other cache
        assert cache.total_size() == 0
        eng.scheduler.check_memory()


def test_load_and_unload_errors_name_the_field_and_change_nothing(models, tmp_path):
    base_dir, folders = models
    # slots of rank 16 for a16's modules (q, v, down); at most two adapters in host memory
    with engine(models, lora_paths=[f"a16={folders['a16']}"], max_loras_per_batch=1, max_loaded_loras=2) as eng:
        manager = eng.scheduler.model_runner.lora_manager
        for name, path, message in [
            ("p", str(tmp_path), "lora_path: .* is not a PEFT LoRA adapter folder"),
            ("p", folders["a64"], "lora_path: adapter 'p' has rank 64, above --max-lora-rank 16"),
            ("p", folders["a8"], "lora_path: adapter 'p' targets gate_proj, k_proj, o_proj, up_proj, not among "
                                 "--lora-target-modules"),
            ("a16", folders["a16"], "lora_name: an adapter named 'a16' is loaded already"),
            ("a:b", folders["a16"], "lora_name: 'a:b' is not a usable adapter name"),
        ]:
            with pytest.raises(ValueError, match=message):
                eng.load_lora_adapter(name, path)
        with pytest.raises(ValueError, match="lora_name: no LoRA adapter 'nope' is loaded \\(loaded: a16\\)"):
            eng.unload_lora_adapter("nope")
        assert manager.loaded() == {"a16": folders["a16"]}
        eng.load_lora_adapter("b", folders["a16"])
        assert manager.adapters["b"].uid == "b#2"  # the failures took no uid
        with pytest.raises(ValueError, match="lora_name: 2 adapters are in host memory, --max-loaded-loras 2"):
            eng.load_lora_adapter("c", folders["a16"])
        eng.unload_lora_adapter("b")  # no request holds it: freed at once, so one more fits
        eng.load_lora_adapter("c", folders["a16"])
        ids = prompts(1, seed=6)[0]
        assert eng.generate(input_ids=ids, sampling_params=GREEDY, lora_path="c")["output_ids"] == \
            reference(models, "a16", ids)
        eng.scheduler.check_memory()
    with radixserve.Engine(model_path=base_dir, device="cpu", disable_tqdm=True) as eng:
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            eng.load_lora_adapter("a8", folders["a8"])
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            eng.unload_lora_adapter("a8")


def test_http_load_and_unload_lora_adapter_with_sglang_bodies_and_the_openai_sdk(models, loading_server):
    import openai

    base_dir, folders = models
    srv = loading_server
    try:
        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(srv.url + path, json=body, timeout=60)

        def generate(adapter: str, ids: list[int]) -> httpx.Response:
            return post("/generate", {"input_ids": ids, "sampling_params": GREEDY, "lora_path": adapter})

        def models_listed() -> list[str]:
            return [c["id"] for c in httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]]

        ids = prompts(1, length=20, seed=7)[0]
        r = post("/load_lora_adapter", {"lora_name": "x", "lora_path": folders["a8"], "pinned": False})
        assert r.status_code == 200, r.text
        assert r.json() == {"success": True, "error_message": None, "loaded_adapters": {
            "a16": folders["a16"], "x": folders["a8"]}}
        assert generate("x", ids).json()["output_ids"] == reference(models, "a8", ids)
        assert models_listed() == ["base", "a16", "x"]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        sdk = client.completions.create(model="base:x", prompt=ids, max_tokens=N_NEW, temperature=0, logprobs=0,
                                        extra_body={"ignore_eos": True})
        native = post("/generate", {"input_ids": ids, "sampling_params": GREEDY, "lora_path": "x",
                                    "return_logprob": True}).json()["meta_info"]["output_token_logprobs"]
        assert sdk.choices[0].logprobs.token_logprobs == pytest.approx([lp[0] for lp in native], abs=1e-4)

        for path, body, param in [
            ("/load_lora_adapter", {"lora_name": "x", "lora_path": folders["a8"]}, "lora_name"),
            ("/load_lora_adapter", {"lora_name": "y", "lora_path": base_dir + "/missing"}, "lora_path"),
            ("/load_lora_adapter", {"lora_name": "y"}, "lora_path"),
            ("/unload_lora_adapter", {"lora_name": "nope"}, "lora_name"),
        ]:
            r = post(path, body)
            body = r.json()
            assert r.status_code == 400 and body["success"] is False and body["error"]["param"] == param, body
            assert body["error_message"] == body["error"]["message"]

        r = post("/unload_lora_adapter", {"lora_name": "x"})
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {"a16": folders["a16"]}
        r = generate("x", ids)
        assert r.status_code == 400 and "unknown LoRA adapter 'x'" in r.json()["error"]["message"]
        assert models_listed() == ["base", "a16"]
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="base:x", prompt=ids, max_tokens=2)

        assert post("/load_lora_adapter", {"lora_name": "x", "lora_path": folders["a64"]}).status_code == 200
        out = generate("x", ids).json()
        assert out["meta_info"]["cached_tokens"] == 0 and out["output_ids"] == reference(models, "a64", ids)
        assert srv.wait_idle()["memory_check"] == "ok"
    finally:
        assert srv.stop() == 0
