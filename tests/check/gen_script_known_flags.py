"""Fill the ``known`` flag lists of src/oomless/data/script_flags.json (not a test; run by
hand). Each tool's flags are the argument names of its own argument classes, read with
``ast`` from its repository at the commit named (dataclass fields and argparse
``--names``), from git clones under MIRRORS/OWNER+NAME/repo (any clone works:
change ``show``/``ls``).

    python tests/check/gen_script_known_flags.py MIRRORS Known flags only warn when unknown elsewhere; they never make
check say it cannot tell.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

MIRRORS = sys.argv[1] if len(sys.argv) > 1 else "."
FLAGS_FILE = Path(__file__).resolve().parents[2] / "src" / "oomless" / "data" / "script_flags.json"


def show(repo, rev, path):
    return subprocess.run(
        ["git", "-C", f"{MIRRORS}/{repo}/repo", "show", f"{rev}:{path}"],
        capture_output=True,
        text=True,
    ).stdout


def ls(repo, rev, under):
    return subprocess.run(
        ["git", "-C", f"{MIRRORS}/{repo}/repo", "ls-tree", "-r", "--name-only", rev, under],
        capture_output=True,
        text=True,
    ).stdout.split()


def names(src):
    out = set()
    tree = ast.parse(src)
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "add_argument":
            for a in n.args:
                if (
                    isinstance(a, ast.Constant)
                    and isinstance(a.value, str)
                    and a.value.startswith("--")
                ):
                    out.add(a.value[2:])
        if isinstance(n, ast.ClassDef):
            for b in n.body:
                if (
                    isinstance(b, ast.AnnAssign)
                    and isinstance(b.target, ast.Name)
                    and not b.target.id.startswith("_")
                ):
                    out.add(b.target.id)
    return out


spec = {
    "qwen-finetune": [("QwenLM+Qwen", "73b34d4a9d32b2cf5c40c10ccd4e1a749deb6b50", ["finetune.py"])],
    "minicpm-v": [
        ("OpenBMB+MiniCPM-V", "53c0174797d9b6505a91122ee5f59fb20a4cabc9", ["finetune/finetune.py"])
    ],
    "internvl": [
        (
            "OpenGVLab+InternVL",
            "c981100b38497e66b666f5e24239a8ae382f89dc",
            ["internvl_chat/internvl/train/internvl_chat_finetune.py"],
        )
    ],
    "deepspeed-chat": [
        (
            "microsoft+DeepSpeedExamples",
            "eefb0ef3651f686b1217eb91ed5e7333dd388a77",
            ["applications/DeepSpeed-Chat/training/step1_supervised_finetuning/main.py"],
        )
    ],
    "firefly": [
        (
            "yangjianxin1+Firefly",
            "9eb960208f950dffdf178c411cee1f6bc8022c61",
            ["component/argument.py"],
        )
    ],
    "openrlhf": [
        (
            "OpenRLHF+OpenRLHF",
            "765a9a5c124ef29bfb2e002460abc153de1f39aa",
            ["openrlhf/cli/train_sft.py", "openrlhf/cli/train_dpo.py", "openrlhf/cli/train_rm.py"],
        ),
        (
            "OpenRLHF+OpenRLHF",
            "3c3be6234e0cb353e76bb8019947db9dfe99fca7",
            ["openrlhf/cli/train_sft.py", "openrlhf/cli/train_dpo.py", "openrlhf/cli/train_rm.py"],
        ),
    ],
}
sw = ("modelscope+ms-swift", "3602360a562313afbf2ef6065fdf61f271a2c5b9")
spec["swift"] = [
    (
        sw[0],
        sw[1],
        [
            p
            for p in ls(sw[0], sw[1], "swift/arguments") + ["swift/trainers/arguments.py"]
            if p.endswith(".py")
        ],
    )
]
d = json.load(open(FLAGS_FILE))
for tool, items in spec.items():
    ks = set()
    srcs = []
    for repo, rev, paths in items:
        for p in paths:
            t = show(repo, rev, p)
            if not t:
                print("MISSING", repo, p)
                continue
            ks |= names(t)
        srcs.append(
            f"https://github.com/{repo.replace('+', '/')}/tree/{rev} ({', '.join(paths) if len(paths) < 4 else 'swift/arguments/**.py, swift/trainers/arguments.py'})"
        )
    d["tools"][tool]["known"] = sorted(ks)
    d["tools"][tool]["known_from"] = " ; ".join(srcs)
    print(tool, len(ks))
json.dump(
    d, open(FLAGS_FILE, "w"), indent=1, ensure_ascii=False
)
open(FLAGS_FILE, "a").write("\n")
