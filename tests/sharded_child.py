"""Run by tests/test_sharded_decoding.py in a process of its own with several simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=N): decodes on one device, then over each mesh,
and prints what matched as one JSON line. A model directory (argv[1]) or a family of tiny random models.

Several cases (`"cases"`) share one process: a list of reports. Each report holds the one-device
tokens (`"reference"`) beside each mesh's. Greedy speculative methods are held to one device's plain
greedy tokens, which they equal there (tests/test_decoding.py): one compile fewer per method.

As one of several processes (`"processes"`), which join through `jax.distributed` and decode over
one mesh of all their devices (the checkpoint saved beforehand by a one-device run), it prints the
tokens instead."""

import json
import sys

import jax
import numpy as np
from reference import tiny_model

import s3d_jax
from s3d_jax import checkpoint, quant, sharding

# Families: heads and key/value heads chosen so that some mesh sizes divide them and others do not.
FAMILIES = {
    "llama": dict(num_heads=8, num_kv_heads=4, head_dim=8, hidden_size=32, intermediate_size=96, vocab_size=98, mask_token_id=97),
    "qwen3": dict(architecture="qwen3", num_heads=12, num_kv_heads=6, head_dim=8, hidden_size=48, intermediate_size=96, vocab_size=98,
                  mask_token_id=97, qk_norm=True, tie_embeddings=True),
    "gemma2": dict(architecture="gemma2", num_heads=6, num_kv_heads=3, head_dim=8, hidden_size=48, intermediate_size=96, vocab_size=98,
                   mask_token_id=97, post_norms=True, norm_plus_one=True, scale_embeddings=True, attn_softcap=50.0, final_softcap=30.0,
                   hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=8, tie_embeddings=True),
    # int8 projections (quant.py): inputs of whole groups of 32.
    "llama_int8": dict(num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=64, intermediate_size=128, vocab_size=98, mask_token_id=97),
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 13, 3, 4, 2]]
METHODS = {"ar": dict(method="ar"), "s3d_tree": dict(), "s3d_chain": dict(tree=0), "selfspec": dict(method="selfspec"),
           "sampled": dict(temperature=0.8, top_p=0.9, seed=3)}


GREEDY_SPECULATIVE = ("s3d", "s3d_tree", "s3d_chain", "selfspec")


def reference_of(method: str) -> str:
    """The one-device output a method's over a mesh must equal."""
    return "ar" if method in GREEDY_SPECULATIVE else method


def plain_options(methods) -> dict:
    """The plain method's options among `methods` (a real model's chat flag with them), else the tiny models'."""
    return methods.get("ar", METHODS["ar"])


def outputs(model, prompts, new_tokens: int, methods) -> dict:
    found = {name: s3d_jax.decode(model, prompts, max_new_tokens=new_tokens, **kw).tokens for name, kw in methods.items()}
    plain = plain_options(methods)  # streamed plainly whatever the methods compared
    found["streamed"] = list(s3d_jax.stream(model, prompts, max_new_tokens=new_tokens, chunk_iterations=2, **plain))[-1].tokens
    return found


def per_device_bytes(params) -> list[int]:
    held = np.zeros(jax.device_count(), np.int64)
    for x in jax.tree.leaves(params):
        for shard in x.addressable_shards:
            held[shard.device.id] += shard.data.nbytes
    return held.tolist()


def decode_case(spec: dict) -> dict:
    """One model's report: its one-device tokens, then, per mesh, what differed from them or why the mesh was refused."""
    if spec.get("model_dir"):
        load = dict(path=spec["model_dir"], drafter=spec.get("drafter"))
        one = s3d_jax.load(**load)
        prompts = [[{"role": "user", "content": c}] for c in spec["chats"]]
        methods = {"ar": dict(method="ar", chat=True), "s3d": dict(chat=True)}
    else:
        model = tiny_model(seed=2, **FAMILIES[spec["family"]])
        one = s3d_jax.Model(model.params, model.config.replace(draft_skip=(1, 2), draft_gamma=3, draft_tree=4))
        if spec["family"].endswith("_int8"):
            one = s3d_jax.Model(quant.quantize_params(one.params, "int8"), one.config.replace(dtype="int8"))
        path = checkpoint.save(spec["tmp"], one.params, one.config)
        load, prompts = dict(path=str(path), drafter=None), PROMPTS
        methods = {k: METHODS[k] for k in spec.get("methods", METHODS)}
    one_device = {reference_of(k): methods.get(reference_of(k), plain_options(methods)) for k in methods}
    reference = outputs(one, prompts, spec["new_tokens"], one_device)
    report = {"reference": reference}
    for n in spec["meshes"]:
        try:
            # jax.make_mesh's own (Explicit axes by default) where the spec asks for it, else the CLIs' text
            mesh = jax.make_mesh((1, n), ("data", "model"), devices=jax.devices()[:n]) if spec.get("explicit") else f"model={n}"
            sharded = s3d_jax.load(**load, mesh=mesh)
        except ValueError as e:
            report[n] = {"refused": str(e)}
            continue
        got = outputs(sharded, prompts, spec["new_tokens"], methods)
        logits_one = np.asarray(s3d_jax.logits(one, PROMPTS[0]))
        logits_sharded = np.asarray(s3d_jax.logits(sharded, PROMPTS[0]))
        report[n] = {"differ": [k for k in got if got[k] != reference[reference_of(k)]],
                     "logits_max_diff": float(np.max(np.abs(logits_one - logits_sharded))),
                     "bytes": per_device_bytes(sharded.params), "total": int(sum(x.nbytes for x in jax.tree.leaves(one.params)))}
    return report


def main():
    spec = json.loads(sys.argv[1])
    sharding.maybe_initialize_distributed()  # before anything touches a device, as the command lines do
    if spec.get("processes"):
        assert jax.process_count() == spec["processes"], jax.process_count()
        methods = {k: METHODS[k] for k in spec["methods"]}
        print(json.dumps({n: outputs(s3d_jax.load(spec["tmp"], mesh=f"model={n}"), PROMPTS, spec["new_tokens"], methods)
                          for n in spec["meshes"]}))
        return
    print(json.dumps([decode_case(case) for case in spec["cases"]]))


if __name__ == "__main__":
    main()
