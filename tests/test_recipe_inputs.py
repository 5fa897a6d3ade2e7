"""Every local input a recipe in configs/ names (``build/...``) is built by one of the repository's scripts: the demo's
by ``scripts/setup.sh``, the video demo's by ``scripts/demo_video.sh``, every other tiny recipe's by
``scripts/build_inputs.sh``; and a recipe's header names the script that builds its inputs."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD_PATH = re.compile(r"build/[A-Za-z0-9_.-]*[A-Za-z0-9_-]")


def built_by(script: Path) -> set[str]:
    """The ``build/...`` folders a script writes: the paths after ``||`` on its ``[ -f X ] || command`` lines."""
    text = script.read_text().replace("\\\n", " ")
    outputs = set()
    for line in text.splitlines():
        if "||" in line:
            outputs.update(BUILD_PATH.findall(line.split("||", 1)[1]))
    # loops over variants: `--out build/tiny-minimax-$v` for `for v in a b c`
    for names, template in re.findall(r"for v in ([\w ]+); do\s*\n\s*\[.*?\]\s*\|\|.*?(build/[\w-]+)\$v", text):
        outputs.update(template + name for name in names.split())
    return outputs


def test_every_recipe_input_is_built_by_a_script():
    scripts = {name: built_by(REPO / "scripts" / name) for name in ("setup.sh", "build_inputs.sh", "demo_video.sh")}
    assert "build/tiny-minimax-ref2va" in scripts["build_inputs.sh"]  # the variant loop is read
    built = set().union(*scripts.values())
    missing = {}
    for recipe in sorted((REPO / "configs").rglob("*.yaml")):
        for path in set(BUILD_PATH.findall(recipe.read_text())) - built:
            missing.setdefault(path, []).append(str(recipe.relative_to(REPO)))
    assert not missing, f"recipes name inputs no script builds: {missing}"


def test_setup_builds_only_the_demo_inputs():
    """The front door: ``scripts/setup.sh`` builds what ``scripts/demo.sh`` needs and nothing more."""
    demo = "".join((REPO / path).read_text() for path in ("configs/demo/sd3_shapes.yaml", "scripts/demo.sh",
                                                          "benchmarks/demo_colour_accuracy.py"))  # fmt: skip
    demo_inputs = {path.split("/")[0] + "/" + path.split("/")[1] for path in BUILD_PATH.findall(demo)}
    assert built_by(REPO / "scripts/setup.sh") == demo_inputs == {"build/tiny-sd3", "build/shapes"}


def test_recipe_headers_name_the_script_that_builds_their_inputs():
    setup_built = built_by(REPO / "scripts/setup.sh")
    wrong = []
    for recipe in sorted((REPO / "configs").rglob("*.yaml")):
        text = recipe.read_text()
        for script in ("setup.sh", "build_inputs.sh"):
            for sentence in re.findall(rf"`scripts/{re.escape(script)}` builds[^.]*", text):
                named = set(BUILD_PATH.findall(sentence)) - setup_built if script == "setup.sh" else set()
                if named:
                    wrong.append(f"{recipe.relative_to(REPO)}: setup.sh does not build {sorted(named)}")
    assert not wrong, wrong
