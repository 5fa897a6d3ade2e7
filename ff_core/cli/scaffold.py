"""``ff plugins new NAME [--output image|video|video+audio]``: a plugin skeleton that installs, registers, passes the
conformance kit and trains as generated.

The files come from ``ff_core/templates/plugin`` (``string.Template`` placeholders, in file contents and path names):
``common/`` holds what every output shares (``pyproject.toml`` with the ``ff`` entry point, the package's
``__init__.py`` and ``plugin.py`` hooks, the README), and one folder per output (:data:`OUTPUTS`) the family itself:
``adapter.py``, ``testing.py`` (a tiny-checkpoint factory on :mod:`ff_core.testing.tiny`), the conformance test and a
tiny recipe. Each adapter is a small working family whose family-specific stages are marked ``FAMILY:``: text to
image (an SD3-like transformer), text to video (diffusers' ``WanPipeline`` maths, checked against it by the kit), text
to audio+video (a Wan video VAE, an Oobleck audio VAE and LTX-2's audio+video transformer). docs/plugins.md walks from
them to a real family ("Starting a plugin", "Writing a video / audio+video family").
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from string import Template

TEMPLATE_DIR = Path(__file__).parents[1] / "templates" / "plugin"
COMMON_DIR = TEMPLATE_DIR / "common"
NAME_PATTERN = re.compile(r"[a-z][a-z0-9]*([-_][a-z0-9]+)*")  # adapter names: sd3-5, wan2_t2v


@dataclass(frozen=True)
class OutputTemplate:
    """What one ``--output`` generates.

    Attributes:
        folder: its template folder under :data:`TEMPLATE_DIR` (laid over ``common/``).
        summary: what the generated adapter is, for the README.
        dataset_dir: the tiny recipe's dataset folder (relative to the plugin).
        dataset_command: the command that writes it.
        diffusers: the ``diffusers`` requirement of the generated ``pyproject.toml`` (the classes it uses).
    """

    folder: str
    summary: str
    dataset_dir: str
    dataset_command: str
    diffusers: str = "diffusers>=0.35"


OUTPUTS: dict[str, OutputTemplate] = {
    "image": OutputTemplate(
        "image",
        "a small working text-to-image family (one CLIP text encoder, an `AutoencoderKL`, an `SD3Transformer2DModel` "
        "denoiser on rectified flow)",
        "build/shapes", "python -m ff_core.testing.shapes build/shapes --n-train 24"),
    "video": OutputTemplate(
        "video",
        "a small working text-to-video family whose maths is diffusers' `WanPipeline` (a UMT5 text encoder, an "
        "`AutoencoderKLWan`, a `WanTransformer3DModel` denoiser on rectified flow), checked against `WanPipeline` by "
        "the kit's reference checks as generated",
        "build/moving-shapes", "python -m ff_core.testing.tiny build/moving-shapes --kind video"),
    "video+audio": OutputTemplate(
        "video_audio",
        "a small working text-to-audio+video family (a UMT5 text encoder, an `AutoencoderKLWan` for the video, an "
        "`AutoencoderOobleck` for the waveform, LTX-2's `LTX2VideoTransformer3DModel` denoising both streams at once), "
        "with the ordered (video, audio) outputs and two latent components",
        "build/av-clips", "python -m ff_core.testing.tiny build/av-clips --kind video+audio",
        "diffusers>=0.42"),  # LTX2VideoTransformer3DModel's audio+video forward as ff-ltx2 uses it
}  # fmt: skip
"""The outputs ``ff plugins new --output`` generates, by the name the flag takes."""


@dataclass(frozen=True)
class PluginNames:
    """Every name a generated plugin uses, derived from the one the user gives (``ff plugins new my-family``).

    Attributes:
        adapter_name: the registry name recipes write (``model.adapter: my-family``): the given name without ``ff-``.
        dist: the distribution (``ff-my-family``).
        package: the import package (``ff_my_family``).
        module: the name in identifiers (``my_family``: ``build_tiny_my_family``).
        entry_point: the entry point's name in the ``ff`` group (``my-family``).
        class_name: the adapter class (``MyFamilyAdapter``).
        interface_version: the adapter interface the plugin targets (this ff-core's).
    """

    adapter_name: str
    dist: str
    package: str
    module: str
    entry_point: str
    class_name: str
    interface_version: str

    @classmethod
    def from_name(cls, name: str) -> PluginNames:
        """Derive the names; ``ValueError`` when ``name`` is not lowercase letters and digits, parts joined by single
        dashes or underscores (``my-family``, ``wan2_t2v``)."""
        from ff_core import ADAPTER_INTERFACE_VERSION

        base = name.removeprefix("ff-")
        if not NAME_PATTERN.fullmatch(base):
            raise ValueError(f"plugin name {name!r}: use lowercase letters, digits and single dashes or underscores, "
                             "starting with a letter (e.g. my-family, wan2_t2v)")  # fmt: skip
        module = base.replace("-", "_")
        return cls(adapter_name=base, dist=f"ff-{base}", package=f"ff_{module}", module=module, entry_point=base,
                   class_name="".join(p.capitalize() for p in re.split("[-_]", base)) + "Adapter",
                   interface_version=ADAPTER_INTERFACE_VERSION)  # fmt: skip


def template_files(output: str = "image") -> dict[Path, Path]:
    """The template files of ``output``, by their path in the generated plugin (placeholders unsubstituted, without
    ``.tmpl``): ``common/``'s, then the output's folder's, which replace a common file of the same path.

    Raises:
        ValueError: an output not in :data:`OUTPUTS`.
    """
    if output not in OUTPUTS:
        raise ValueError(f"--output must be one of {', '.join(OUTPUTS)}, got {output!r}")
    files: dict[Path, Path] = {}
    for folder in (COMMON_DIR, TEMPLATE_DIR / OUTPUTS[output].folder):
        for source in sorted(folder.rglob("*.tmpl")):
            files[source.relative_to(folder).with_suffix("")] = source
    return files


def new_plugin(name: str, directory: str | Path = ".", output: str = "image") -> Path:
    """Write the skeleton of plugin ``name`` to ``directory/<package>`` (published whole, or not at all) and return it.

    Args:
        name: the family's name (``my-family``; an ``ff-`` prefix is dropped).
        directory: the parent folder (created if missing).
        output: what the family generates, a key of :data:`OUTPUTS`: ``image`` (default), ``video`` or
            ``video+audio``.

    Raises:
        ValueError: a name that cannot be a distribution and registry name, or an unknown output.
        FileExistsError: the plugin folder exists already (nothing is overwritten).
    """
    names = PluginNames.from_name(name)
    files = template_files(output)
    parent = Path(directory)
    target = parent / names.package
    if target.exists():
        raise FileExistsError(f"{target} exists already; choose another --dir or name")
    parent.mkdir(parents=True, exist_ok=True)
    spec = OUTPUTS[output]
    values = {**asdict(names), "output": output, "output_summary": spec.summary, "dataset_dir": spec.dataset_dir,
              "dataset_command": spec.dataset_command, "diffusers": spec.diffusers}  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix=f".{names.package}.", dir=parent))
    try:
        for relative, source in files.items():
            out = tmp / Template(str(relative)).substitute(values)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(Template(source.read_text()).substitute(values))
        tmp.chmod(0o755)  # mkdtemp creates 0700; the published folder is an ordinary one
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
