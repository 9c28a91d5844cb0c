"""The wheelhouse: uv's resolution for the target, the batches of a long sweep and the bitsandbytes trim, on wheels built here (no network)."""

import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from stackcheck.runner import wheelhouse
from stackcheck.runner.envs import EnvBuildError
from stackcheck.core.versions import UsageError, resolve


def make_wheel(folder: Path, name: str, version: str, requires=(), files=()) -> Path:
    stem = f"{name.replace('-', '_')}-{version}"  # a wheel's file name spells the project name with underscores
    wheel = folder / f"{stem}-py3-none-any.whl"
    info = f"{stem}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{info}/METADATA", metadata)
        for path in files:
            archive.writestr(path, b"\0" * 64)
        archive.writestr(f"{info}/RECORD", "".join(f"{p},sha256=x,64\n" for p in files) + f"{info}/RECORD,,\n")
    return wheel


class FakeIndex:
    """A folder of wheels built here: uv resolves from it offline (`index_args`), and the download step takes
    the resolved wheel from it, as `pip download --no-deps` would from the package index."""

    def __init__(self, folder: Path, releases: dict[str, dict[str, list[str]]]):
        self.folder, self.asked = folder / "index", []
        self.folder.mkdir()
        self.wheels = {(name, version): make_wheel(self.folder, name, version, requires)
                       for name, versions in releases.items() for version, requires in versions.items()}
        self.index_args = ["--no-index", "--find-links", str(self.folder), "--no-cache"]

    def __call__(self, name: str, specifier: SpecifierSet) -> Path:
        self.asked.append(f"{name}{specifier}")
        (version,) = [v for n, v in self.wheels if n == name and Version(v) in specifier]
        return self.wheels[name, version]


SEED_RELEASES = {
    "transformers": {"5.6.2": ["huggingface-hub>=1.3,<2", "tokenizers<0.23,>=0.22", "numpy>=1.17"]},
    "peft": {"0.19.1": ["torch>=1.13", "accelerate>=0.21", "transformers"]},
    "accelerate": {"1.13.0": ["torch>=2.0", "psutil", "numpy<3"]},
    "bitsandbytes": {"0.49.2": ["torch<3,>=2.3", "numpy>=1.17", "extra-only; extra == 'dev'"]},
    "pytest": {"9.2.0": ["pluggy<2,>=1.5", "colorama; sys_platform == 'win32'"]},
    "tokenizers": {"0.22.2": [], "0.23.2": []},
    "pluggy": {"1.6.0": []},
    "torch": {"2.11.0": [], "2.13.0": []},
    "huggingface-hub": {"1.33.0": [], "1.40.0": []},
    "numpy": {"2.5.2": [], "2.6.0": []},
    "psutil": {"7.2.2": []},
}


def test_uv_resolves_for_the_target_and_the_host_keeps_what_satisfies(tmp_path, monkeypatch):
    monkeypatch.setattr(wheelhouse, "test_requirements", lambda vset, groups=(): ["pytest==9.2.0"])
    (vset,) = resolve(["seed"])
    index = FakeIndex(tmp_path, SEED_RELEASES)
    host = {"torch": Version("2.11.0"), "huggingface-hub": Version("1.33.0"), "tokenizers": Version("0.23.2"),
            "numpy": Version("2.5.2"), "psutil": Version("7.2.2")}

    wheels = wheelhouse.wheels_for_set(vset, index, "3.12", host, cuda=None, index_args=index.index_args)

    assert sorted(w.name.split("-")[0] for w in wheels) == ["accelerate", "bitsandbytes", "peft", "pluggy", "pytest", "tokenizers", "transformers"]
    assert "tokenizers==0.22.2" in index.asked  # the host's 0.23.2 does not satisfy transformers 5.6.2
    assert not any(a.startswith(("torch", "numpy", "huggingface-hub", "colorama", "extra-only")) for a in index.asked)


def test_a_host_torch_outside_a_pin_cannot_resolve(tmp_path, monkeypatch):
    monkeypatch.setattr(wheelhouse, "test_requirements", lambda vset, groups=(): [])
    (vset,) = resolve(["seed"])
    index = FakeIndex(tmp_path, {"transformers": {"5.6.2": []}, "peft": {"0.19.1": ["torch>=2.12"]},
                                 "accelerate": {"1.13.0": []}, "bitsandbytes": {"0.49.2": []}, "torch": {"2.11.0": [], "2.13.0": []}})
    with pytest.raises(EnvBuildError, match="uv cannot resolve .*torch"):
        wheelhouse.wheels_for_set(vset, index, "3.12", {"torch": Version("2.11.0")}, None, index.index_args)


def test_bitsandbytes_keeps_one_cuda_binary_and_a_consistent_record(tmp_path):
    binaries = [f"bitsandbytes/libbitsandbytes_{v}.so" for v in ("cpu", "cuda118", "cuda128", "cuda130", "rocm64")]
    wheel = make_wheel(tmp_path, "bitsandbytes", "0.49.2", files=["bitsandbytes/__init__.py", *binaries])

    dropped = wheelhouse.keep_one_cuda_binary(wheel, "130")

    assert sorted(dropped) == sorted(b for b in binaries if "cpu" not in b and "cuda130" not in b)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        record = archive.read("bitsandbytes-0.49.2.dist-info/RECORD").decode()
    assert "bitsandbytes/libbitsandbytes_cuda130.so" in names and "bitsandbytes/libbitsandbytes_cpu.so" in names
    assert not any(d in names or d in record for d in dropped)
    with pytest.raises(UsageError, match="has no libbitsandbytes_cuda126.so"):
        wheelhouse.keep_one_cuda_binary(wheel, "126")


def test_a_sweep_splits_into_batches_that_each_fit_one_transfer():
    mib = 2**20
    sets = {"seed": {"wheels": ["peft.whl", "accelerate.whl", "bnb.whl", "t1.whl"]},
            "seed+t2": {"wheels": ["peft.whl", "accelerate.whl", "bnb.whl", "t2.whl"]},
            "seed+t3": {"wheels": ["peft.whl", "accelerate.whl", "bnb.whl", "t3.whl"]},
            "seed+t4": {"wheels": ["peft.whl", "accelerate.whl", "bnb.whl", "t4.whl"]}}
    sizes = {"peft.whl": 1 * mib, "accelerate.whl": 1 * mib, "bnb.whl": 30 * mib, "t1.whl": 12 * mib, "t2.whl": 12 * mib,
             "t3.whl": 12 * mib, "t4.whl": 12 * mib}
    found = wheelhouse.batches(sets, sizes, 64 * mib)
    assert [(b["wheels"], b["completes"]) for b in found] == [
        (["peft.whl", "accelerate.whl", "bnb.whl", "t1.whl", "t2.whl"], ["seed", "seed+t2"]),
        (["t3.whl", "t4.whl"], ["seed+t3", "seed+t4"]),
    ]
    assert all(b["bytes"] <= 64 * mib for b in found)
    with pytest.raises(UsageError, match="more than one 40 MiB batch"):
        wheelhouse.batches(sets, sizes, 40 * mib)
