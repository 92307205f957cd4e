"""GPU profiles for fake execution (memadvisor/gpus.py)."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from memadvisor.errors import UserError
from memadvisor import gpus

# the module, not the package's re-exported hardware() function of the same name
hardware = importlib.import_module("memadvisor.simulate.hardware")


def test_one_set_of_names_with_the_simulator():
    cuda_profiles = {name for name, h in hardware.PROFILES.items() if h.device_type == "cuda"}
    assert set(gpus.GPUS) == cuda_profiles
    for alias, name in hardware.ALIASES.items():
        assert gpus.gpu_profile(alias).name == name
    for name, h in hardware.PROFILES.items():
        capability = getattr(h, "compute_capability", (0, 0))
        if h.device_type == "cuda" and capability != (0, 0):
            assert gpus.GPUS[name].capability == tuple(capability), name
        if h.device_type == "cuda":  # bf16 in the simulator = native bf16 here
            assert gpus.GPUS[name].bf16_supported == h.bf16, name


def test_h100_reports_what_torch_reports_on_the_part():
    h100 = gpus.gpu_profile("H100")
    assert h100.total_memory_bytes == 85_017_755_648  # 79.18 GiB
    assert h100.device_name == "NVIDIA H100 80GB HBM3"
    assert h100.capability == (9, 0) and h100.multi_processor_count == 132
    assert h100.cublas_workspace_bytes == 32 * 1024**2
    assert gpus.gpu_profile("a100-40gb").cublas_workspace_bytes == 8_519_680


def test_every_profile_is_smaller_than_its_marketing_size():
    for profile in gpus.GPUS.values():
        nominal_gb = int(profile.name.rsplit("-", 1)[1].removesuffix("gb"))
        # torch reports what the driver leaves: a few percent under the nominal GiB
        assert 0.9 * nominal_gb * 2**30 < profile.total_memory_bytes < nominal_gb * 2**30, profile


def test_unknown_gpu_is_a_user_error_listing_the_known_ones():
    with pytest.raises(UserError, match="h100-80gb"):
        gpus.gpu_profile("b300")
    assert gpus.gpu_profile(None).name == gpus.DEFAULT_GPU


def test_importing_the_package_does_not_import_torch():
    code = ("import sys, memadvisor.fake, memadvisor.fake.shim; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False"
