"""`agoq profile`'s collective-kernels stage (agoq.commands.profile_kernels): a profile gets profile.json
`collective_kernels` at sizes spanning the model's FSDP2 units; `--resume` of a profile without it adds it, of one with
it keeps it."""

import json

from agoq.cli import main
from agoq.commands.profile_kernels import unit_values
from agoq.formats.collective_kernels import PATHS
from agoq.formats.profile import load_profile

FAST = ["--quiet", "--bits", "4", "--formats", "int", "--batches", "1", "--seq-len", "13", "--micro-batch", "1",
        "--measured-steps", "0"]


def test_a_profile_times_the_kernels_and_resume_adds_them_to_an_older_one(tmp_path):
    from agoq.models import build
    from agoq.runtime.activations.saved_bytes import find_decoder_layers

    out = tmp_path / "p"
    assert main(["profile", "llama-tiny", *FAST, "--out", str(out)]) == 0
    profile = load_profile(out)
    rows = profile.collective_kernels()
    assert {(r["op"], r["path"]) for r in rows} == set(PATHS) and all(r["seconds"] > 0 for r in rows)
    section = profile.header["collective_kernels"]
    assert section["version"] == 2 and section["device"] == "cpu" and section["world_size"] == 2
    model = build("llama-tiny")  # the units counted on the built model, not from its config
    layers = find_decoder_layers(model)
    layer = sum(p.numel() for p in layers[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - len(layers) * layer
    assert unit_values(profile.header) == (layer, root)
    sizes = sorted({r["message_bytes"] for r in rows})
    assert len(sizes) == 3 and sizes[0] >= 4 * min(layer, root) and sizes[-1] >= 4 * max(layer, root)

    header = json.loads((out / "profile.json").read_text())  # an older profile: no section
    del header["collective_kernels"]
    (out / "profile.json").write_text(json.dumps(header))
    assert load_profile(out).collective_kernels() == []
    assert main(["profile", "llama-tiny", *FAST, "--resume", "--out", str(out)]) == 0
    added = json.loads((out / "profile.json").read_text())
    assert {(r["op"], r["path"]) for r in added["collective_kernels"]["rows"]} == set(PATHS)
    assert {k: v for k, v in added.items() if k != "collective_kernels"} == header  # nothing else changed
    assert main(["profile", "llama-tiny", *FAST, "--resume", "--out", str(out)]) == 0
    assert json.loads((out / "profile.json").read_text()) == added  # kept, not timed again

    old = json.loads(json.dumps(added))  # a version 1 section: no int4 level, timed again by --resume
    old["collective_kernels"]["version"] = 1
    old["collective_kernels"]["rows"] = [r for r in old["collective_kernels"]["rows"]
                                         if r["path"] != "sdp4bit-int4-level"]
    (out / "profile.json").write_text(json.dumps(old))
    assert main(["profile", "llama-tiny", *FAST, "--resume", "--out", str(out)]) == 0
    again = json.loads((out / "profile.json").read_text())
    assert again["collective_kernels"]["version"] == 2
    assert {(r["op"], r["path"]) for r in again["collective_kernels"]["rows"]} == set(PATHS)
