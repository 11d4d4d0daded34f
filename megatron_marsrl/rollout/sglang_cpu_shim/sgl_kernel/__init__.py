"""Import-only stand-in for SGLang's CUDA kernel package on CPU machines.

SGLang 0.5.23 imports these names from sgl_kernel at module level, but on the CPU
torch-native path (SGLANG_USE_CPU_ENGINE=1) never calls them. The real package only ships
CUDA builds. Every stand-in raises if called, and records the call in CALLED so a test can
assert the torch-native path stayed free of them. Only on CPU is the directory above put first
on the path of the processes that run SGLang: rollout/sglang_engine.py prepare_cpu_environment
(the in-process engine and the processes it spawns) and rollout/sglang_server.py (a server).
"""
import os

CALLED: list[str] = []

_NAMES = (
    "copy_all_layer_kv_cache_cpu", "assign_req_to_token_pool_cpu", "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_cpu", "assign_draft_cache_locs_page_size_1_cpu", "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu", "fill_bonus_tokens_cpu", "fill_accept_out_cache_loc_cpu", "assign_draft_cache_locs_contiguous_cpu", "fill_accepted_out_cache_loc_cpu", "fill_new_verified_id_cpu", "rmsnorm",
)


def _stand_in(name):
    def call(*args, **kwargs):
        CALLED.append(name)
        log = os.environ.get("MARSRL_SGL_KERNEL_CALL_LOG")
        if log:  # the calls happen in SGLang's scheduler process: leave a trace for the tests
            with open(log, "a") as f:
                f.write(name + "\n")
        raise RuntimeError(f"sgl_kernel.{name} is a CPU import stand-in and must not be called "
                           "(the torch-native CPU path was expected not to use it)")

    call.__name__ = name
    return call


for _name in _NAMES:
    globals()[_name] = _stand_in(_name)
