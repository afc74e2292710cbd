"""The DeepSpeed baselines without DeepSpeed: their config, their refusals, the libaio route, and the
host admission on several GPUs (ZeRO-3 and FSDP2 alike).

Training itself needs a GPU and DeepSpeed; it is checked on the GPU machine, not here.
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from megatrain.distributed import Ranks
from megatrain.shapes import ModelShape
from suite.spec import RunSpec
from megatrain.memory import DoesNotFit
from megatrain.units import GiB
from baselines import deepspeed_zero, hf
from baselines.fsdp2 import FSDP2
from baselines.deepspeed_zero import ZeRO3Offload, ZeROInfinity, ds_config
from suite.system import Unsupported

REPO = Path(__file__).resolve().parents[2]


def spec(system: str, preset: str = "tiny-qwen2", **kw) -> RunSpec:
    return RunSpec(system=system, model={"preset": preset}, seq_len=32, batch_size=2, **kw)


def test_zero3_offload_config():
    c = ds_config(spec("zero3", grad_accum=3, lr=3e-4), "cpu")
    z = c["zero_optimization"]
    assert z["stage"] == 3
    assert z["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert c["bf16"] == {"enabled": True}
    assert c["optimizer"] == {"type": "AdamW",
                              "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}}
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["train_batch_size"]) == (2, 3, 6)
    assert c["gradient_clipping"] == 0.0
    assert "aio" not in c


def test_zero3_config_on_several_gpus_splits_the_global_batch():
    # batch_size is the global micro-batch: each of the 4 ranks takes 2 of its 8 rows
    c = ds_config(RunSpec(system="zero3", model={"preset": "tiny-qwen2"}, seq_len=32, batch_size=8, grad_accum=3,
                          gpus=4), "cpu")
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["train_batch_size"]) == (2, 3, 24)


@pytest.mark.parametrize("system", [ZeRO3Offload, FSDP2])
def test_host_admission_counts_the_ranks(system, monkeypatch):
    """The state is sharded over the ranks (its total stays); each further rank adds its own part
    and its runtime. A host that holds the point on 1 GPU refuses it on 4, saying why."""
    one, four = (RunSpec(system="zero3", model={"preset": "qwen2.5-7b"}, batch_size=4, gpus=g) for g in (1, 4))
    p = hf.params(one)
    need = {g: hf.host_need(s, system.HOST_BYTES_PER_PARAM, system.RANK_BYTES_PER_PARAM)[0]
            for g, s in ((1, one), (4, four))}
    assert need[1] == int(p * system.HOST_BYTES_PER_PARAM)
    assert need[4] == int(p * system.HOST_BYTES_PER_PARAM + 3 * (p * system.RANK_BYTES_PER_PARAM + hf.RANK_HOST_BYTES))
    monkeypatch.setenv("MEGATRAIN_HOST_MEMORY_GB", str((need[1] + need[4]) / 2 / GiB))
    hf.require_host(one, system.HOST_BYTES_PER_PARAM, "x", system.RANK_BYTES_PER_PARAM)
    with pytest.raises(DoesNotFit, match=r"sharded over 4 ranks, \+ 3 further rank\(s\)") as e:
        hf.require_host(four, system.HOST_BYTES_PER_PARAM, "x", system.RANK_BYTES_PER_PARAM)
    assert e.value.memory == "host"


@pytest.mark.parametrize("preset", ["tiny-qwen2", "qwen2.5-7b"])
def test_zero_infinity_config_buffers_hold_the_largest_tensor(preset):
    s = spec("zero_infinity", preset)
    c = ds_config(s, "nvme", "/swap")
    param, opt = c["zero_optimization"]["offload_param"], c["zero_optimization"]["offload_optimizer"]
    assert param["device"] == opt["device"] == "nvme"
    assert param["nvme_path"] == opt["nvme_path"] == "/swap"
    shape = ModelShape(s.hf_config())
    assert param["buffer_size"] >= shape.vocab * shape.hidden
    assert param["buffer_size"] >= max(p.numel for p in shape.layer_specs)
    assert param["buffer_count"] == 2 * len(shape.layer_specs) + 4
    assert param["max_in_cpu"] == 10**9
    assert set(c["aio"]) == {"block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events"}


def test_options_deep_merge_over_the_built_config():
    over = {"zero_optimization": {"offload_param": {"buffer_count": 8}}, "gradient_clipping": 1.0}
    c = ds_config(spec("zero_infinity", options={"ds_config": over, "nvme_path": "/swap"}), "nvme", "/swap")
    assert c["zero_optimization"]["offload_param"]["buffer_count"] == 8
    assert c["zero_optimization"]["offload_param"]["device"] == "nvme"  # siblings kept
    assert c["zero_optimization"]["stage"] == 3
    assert c["gradient_clipping"] == 1.0


@pytest.mark.parametrize("options", [{"nvme_path": "/swap"}, {"zero_optimization": {}}, {"ds_config": 3}])
def test_bad_options_are_refused(options):
    with pytest.raises(ValueError, match="options"):
        ds_config(spec("zero3", options=options), "cpu")


@pytest.mark.parametrize("name, system", [("zero3", ZeRO3Offload), ("zero_infinity", ZeROInfinity)])
def test_missing_deepspeed_is_unsupported(name, system, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` fail
    with pytest.raises(Unsupported, match=r"deepspeed is not installed \(pip install -e '\.\[baselines\]'\)"):
        system(spec(name), torch.device("cpu"))


@pytest.fixture
def fake_deepspeed(monkeypatch, tmp_path):
    """No DeepSpeed and no process group: the constructor gets as far as its admission (its ops'
    build directories under tmp_path)."""
    monkeypatch.setattr(deepspeed_zero, "import_deepspeed", lambda: None)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    monkeypatch.setattr(deepspeed_zero, "_init_distributed", lambda deepspeed, device: (Ranks(), {}))


def test_a_one_process_run_puts_the_environment_back(monkeypatch):
    """DeepSpeed reads its one-process group from the environment: the variables stay for the run
    and `close` puts back what was there before (a later run in the process, or a worker started
    from it, would inherit the port)."""
    joined = []
    fake = type("DeepSpeed", (), {"init_distributed": staticmethod(lambda verbose: joined.append(dict(os.environ)))})
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    environ = dict(os.environ)
    ranks, before = deepspeed_zero._init_distributed(fake, torch.device("cuda", 1))
    assert not ranks.distributed and joined[0]["LOCAL_RANK"] == "1" and joined[0]["MASTER_ADDR"] == "127.0.0.1"
    assert int(os.environ["MASTER_PORT"]) > 0
    system = ZeRO3Offload.__new__(ZeRO3Offload)
    system.engine, system._environ_before = type("Engine", (), {"destroy": lambda self: None})(), before
    system.close()
    assert dict(os.environ) == environ


def test_cpu_device_is_unsupported(fake_deepspeed):
    with pytest.raises(Unsupported, match="CUDA device"):
        ZeRO3Offload(spec("zero3"), torch.device("cpu"))


def test_zero3_refuses_a_model_the_host_cannot_hold(fake_deepspeed):
    with pytest.raises(DoesNotFit, match="29 B/param") as e:
        ZeRO3Offload(spec("zero3", "qwen2.5-72b"), torch.device("cuda"))
    assert e.value.memory == "host"


def test_zero_infinity_without_libaio_says_why(fake_deepspeed, monkeypatch):
    reason = "async_io requires the dev libaio .so object and headers but these were not found."
    monkeypatch.setattr(deepspeed_zero, "aio_problem", lambda: reason)
    with pytest.raises(Unsupported) as e:
        ZeROInfinity(spec("zero_infinity"), torch.device("cuda"))
    assert reason in str(e.value) and "baselines/libaio.sh" in str(e.value)


def test_zero_infinity_refuses_a_model_the_swap_cannot_hold(fake_deepspeed, monkeypatch, tmp_path):
    monkeypatch.setattr(deepspeed_zero, "aio_problem", lambda: None)
    swap = tmp_path / "swap"
    with pytest.raises(DoesNotFit, match="disk space: needs .* GiB available") as e:
        ZeROInfinity(spec("zero_infinity", "qwen2.5-72b", options={"nvme_path": str(swap)}), torch.device("cuda"))
    assert e.value.memory == "disk" and not swap.exists()


def test_a_swap_keeps_room_for_the_run_s_other_files(monkeypatch, tmp_path):
    """A disk that holds the swap's bound but not DISK_RESERVE beside it refuses (ZeRO-Infinity at 7B
    filled such a disk); room for both admits."""
    usage = shutil.disk_usage(tmp_path)
    for spare, fits in ((0, False), (hf.DISK_RESERVE, True)):
        monkeypatch.setattr(shutil, "disk_usage", lambda _, f=10**9 * 18 + spare: usage._replace(free=f))
        if fits:
            hf.require_disk("ZeRO-Infinity", 10**9, 18, str(tmp_path))
        else:
            with pytest.raises(DoesNotFit, match=r"disk space: needs 18.8 GiB, 16.8 GiB available .*\+ 2 GiB") as e:
                hf.require_disk("ZeRO-Infinity", 10**9, 18, str(tmp_path))
            assert e.value.memory == "disk"


def _deb(path: Path, files: dict[str, bytes], links: dict[str, str]) -> None:
    """A minimal .deb: an ar archive of debian-binary, control.tar.gz and data.tar.gz."""
    def tar(entries) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as t:
            for info, data in entries:
                t.addfile(info, io.BytesIO(data) if data is not None else None)
        return buf.getvalue()

    def file(name, data):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        return info, data

    def link(name, target):
        info = tarfile.TarInfo(name)
        info.type, info.linkname = tarfile.SYMTYPE, target
        return info, None

    members = {"debian-binary": b"2.0\n",
               "control.tar.gz": tar([file("./control", b"Package: fake\n")]),
               "data.tar.gz": tar([file(f"./{n}", d) for n, d in files.items()] +
                                  [link(f"./{n}", t) for n, t in links.items()])}
    with open(path, "wb") as f:
        f.write(b"!<arch>\n")
        for name, data in members.items():
            f.write(f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode())
            f.write(data + b"\n" * (len(data) % 2))


@pytest.mark.skipif(not shutil.which("bash") or not (shutil.which("dpkg") or shutil.which("ar")),
                    reason="libaio.sh needs bash, and dpkg or ar")
def test_libaio_env_unpacks_into_a_prefix_and_fixes_absolute_links(tmp_path):
    debs = tmp_path / "debs"
    debs.mkdir()
    lib = "lib/x86_64-linux-gnu"
    # the layout of older Debian/Ubuntu: runtime in /lib, dev link in /usr/lib pointing at it absolutely
    _deb(debs / "libaio1_0.3_amd64.deb", {f"{lib}/libaio.so.1.0.1": b"elf"}, {f"{lib}/libaio.so.1": "libaio.so.1.0.1"})
    _deb(debs / "libaio-dev_0.3_amd64.deb", {"usr/include/libaio.h": b"/* */"},
         {f"usr/{lib}/libaio.so": f"/{lib}/libaio.so.1.0.1"})
    prefix = tmp_path / "prefix"
    env = {**os.environ, "LIBAIO_PREFIX": str(prefix), "LD_LIBRARY_PATH": "/old"}
    out = subprocess.run(["bash", str(REPO / "baselines/libaio.sh"), "env", str(debs)], env=env,
                         capture_output=True, text=True, check=True).stdout
    exports = dict(line.removeprefix("export ").split("=", 1) for line in out.splitlines())
    assert set(exports) == {"CFLAGS", "LDFLAGS", "CPATH", "LIBRARY_PATH", "LD_LIBRARY_PATH"}
    assert exports["CPATH"] == str(prefix / "usr/include") and exports["CFLAGS"] == f"-I{prefix}/usr/include"
    assert exports["LD_LIBRARY_PATH"].split(":")[-1] == "/old"
    assert str(prefix / lib) in exports["LIBRARY_PATH"].split(":")
    dev_link = prefix / "usr" / lib / "libaio.so"
    assert dev_link.resolve() == (prefix / lib / "libaio.so.1.0.1").resolve()


def test_libaio_env_without_debs_says_what_to_run(tmp_path):
    run = subprocess.run(["bash", str(REPO / "baselines/libaio.sh"), "env", str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "fetch" in run.stderr


def test_arch_list_loses_arch_specific_suffixes(monkeypatch):
    from baselines.deepspeed_zero import _plain_arch_list
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a;10.0f+PTX")
    _plain_arch_list()
    import os
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0;10.0+PTX"


def test_a_stale_build_lock_is_refused_by_name(fake_deepspeed):
    """A JIT build of DeepSpeed's ops killed half way leaves torch's lock file, on which the next
    build waits forever: an old one stops the point at once, naming the file; a fresh one (a build
    under way) does not."""
    from torch.utils.cpp_extension import _get_build_directory
    lock = Path(_get_build_directory("cpu_adam", verbose=False)) / "lock"
    lock.touch()
    assert deepspeed_zero.stale_build_locks() == []
    hour_ago = time.time() - 3600
    os.utime(lock, (hour_ago, hour_ago))
    with pytest.raises(Unsupported, match="interrupted build") as e:
        ZeRO3Offload(spec("zero3"), torch.device("cuda"))
    assert str(lock) in str(e.value) and "60 min old" in str(e.value)
