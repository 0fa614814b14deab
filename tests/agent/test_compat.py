"""Switching from torchrun or accelerate by changing one word: their flags, defaults, error files
and the environment their launchers give a script, checked with real processes."""

import json
import os
import re
import subprocess
import unittest

import harness
from harness import LAUNCH, SYSTEM_PYTHON, launch, tmpdir

# `accelerate launch`'s flags (accelerate/commands/launch.py, 1.x): value-taking flags get a
# sample value, switches none. torchrun's positional script is given separately.
ACCELERATE_VALUE_FLAGS = [
    "config_file", "mixed_precision", "num_processes", "num_machines",
    "num_cpu_threads_per_process", "dynamo_backend", "dynamo_mode", "gpu_ids", "machine_rank",
    "main_process_ip", "main_process_port", "tee", "log_dir", "role", "rdzv_backend", "rdzv_conf",
    "max_restarts", "monitor_interval", "vm", "env", "main_training_function",
    "deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
    "offload_optimizer_nvme_path", "offload_param_nvme_path", "gradient_accumulation_steps",
    "gradient_clipping", "zero3_init_flag", "zero3_save_16bit_model", "deepspeed_hostfile",
    "deepspeed_exclusion_filter", "deepspeed_inclusion_filter", "deepspeed_multinode_launcher",
    "deepspeed_moe_layer_cls_names", "fsdp_version", "fsdp_offload_params", "fsdp_min_num_params",
    "fsdp_sharding_strategy", "fsdp_reshard_after_forward", "fsdp_auto_wrap_policy",
    "fsdp_transformer_layer_cls_to_wrap", "fsdp_backward_prefetch", "fsdp_state_dict_type",
    "fsdp_forward_prefetch", "fsdp_use_orig_params", "fsdp_cpu_ram_efficient_loading",
    "fsdp_sync_module_states", "fsdp_activation_checkpointing", "megatron_lm_tp_degree",
    "megatron_lm_use_custom_fsdp", "megatron_lm_no_load_optim", "megatron_lm_eod_mask_loss",
    "megatron_lm_overlap_cpu_optimizer_d2h_h2d", "megatron_lm_no_save_optim",
    "megatron_lm_optimizer_cpu_offload", "megatron_lm_use_precision_aware_optimizer",
    "megatron_lm_decoder_last_pipeline_num_layers", "megatron_lm_pp_degree",
    "megatron_lm_num_micro_batches", "megatron_lm_sequence_parallelism",
    "megatron_lm_recompute_activations", "megatron_lm_use_distributed_optimizer",
    "megatron_lm_gradient_clipping", "megatron_lm_recompute_granularity",
    "megatron_lm_recompute_method", "megatron_lm_recompute_num_layers",
    "megatron_lm_attention_backend", "megatron_lm_expert_model_parallel_size",
    "megatron_lm_context_parallel_size", "megatron_lm_attention_dropout",
    "megatron_lm_hidden_dropout", "megatron_lm_attention_softmax_in_fp32",
    "megatron_lm_expert_tensor_parallel_size", "megatron_lm_calculate_per_token_loss",
    "megatron_lm_use_rotary_position_embeddings", "fp8_backend", "fp8_margin", "fp8_interval",
    "fp8_format", "fp8_amax_history_len", "fp8_amax_compute_algo",
    "fp8_override_linear_precision", "fp8_opt_level", "fp8_enable_fsdp_float8_all_gather",
    "fp8_pad_inner_dim", "aws_access_key_id", "aws_secret_access_key",
    "parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size",
    "parallelism_config_tp_size", "parallelism_config_cp_size", "parallelism_config_cp_backend",
    "parallelism_config_cp_comm_strategy", "parallelism_config_sp_size",
    "parallelism_config_sp_backend", "parallelism_config_sp_seq_length",
    "parallelism_config_sp_seq_length_is_variable", "parallelism_config_sp_attn_implementation",
]
ACCELERATE_SWITCHES = [
    "quiet", "q", "cpu", "multi_gpu", "enable_cpu_affinity", "dynamo_use_fullgraph",
    "dynamo_use_dynamic", "dynamo_use_regional_compilation", "use_deepspeed", "use_fsdp",
    "use_parallelism_config", "use_megatron_lm", "same_network", "module", "m", "no_python",
    "tpu_cluster", "no_tpu_cluster", "tpu_use_sudo", "downcast_bf16", "fp8_use_autocast_during_eval",
    "debug",
]
# Accepted on purpose with an error that says why (no counterpart in launch).
ACCELERATE_REFUSED = {"tpu": "not TPUs", "mpirun_hostfile": "mpirun ... launch"}

# torchrun's flags after 1.13 (current main): flag -> sample value (None = a switch).
TORCHRUN_NEW_FLAGS = {
    "local-addr": "127.0.0.1", "local-ranks-filter": "0", "event-log-handler": "null",
    "signals-to-handle": "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "shutdown-timeout": "12",
    "virtual-local-rank": None, "nproc-per-node": "1", "rdzv-conf": "join_timeout=60",
    "max-restarts": "0", "monitor-interval": "0.1", "start-method": "spawn", "no-python": None,
    "run-path": None, "log-dir": "/tmp", "node-rank": "0", "master-addr": "127.0.0.1",
    "master-port": "29500", "rdzv-backend": "c10d", "rdzv-endpoint": "127.0.0.1:29400",
    "rdzv-id": "x",
}
TORCHRUN_REFUSED = {"logs-specs": "LogsSpecs", "numa-binding": "numactl",
                    "duplicate-stdout-filters": "--tee", "duplicate-stderr-filters": "--tee"}

MINIMAL_CONFIG = "distributed_type: MULTI_CPU\nnum_processes: 1\n"


def installed_torchrun_flags():
    """Every option of the installed torchrun (Debian 12's torch 1.13, Debian 13's 2.6), from its
    own parser."""
    code = ("import json; from torch.distributed.run import get_args_parser as g; "
            "print(json.dumps([[a.option_strings, a.nargs, a.const] for a in g()._actions "
            "if a.option_strings and a.dest != 'help']))")
    out = subprocess.run([SYSTEM_PYTHON, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


class FlagsParse(unittest.TestCase):
    def print_config(self, *args, **kw):
        return launch(*args, "--print_config", "--", "/bin/true", **kw)

    def test_every_flag_of_the_installed_torchrun_parses_or_says_why_not(self):
        samples = {"--nnodes": "1", "--nproc_per_node": "1", "--rdzv_conf": "join_timeout=9",
                   "--rdzv_endpoint": "127.0.0.1:29400", "--max_restarts": "0",
                   "--monitor_interval": "5", "--start_method": "spawn", "--redirects": "0",
                   "--tee": "0", "--node_rank": "0", "--master_port": "29500", "--role": "r",
                   "--log_dir": tmpdir(), "--master_addr": "127.0.0.1", "--rdzv_id": "x",
                   "--rdzv_backend": "static"}
        flags = installed_torchrun_flags()
        self.assertGreaterEqual(len(flags), 20)
        for options, nargs, const in flags:
            flag = options[-1] if options[-1].startswith("--") else options[0]
            args = [flag] if nargs == 0 else [flag, samples.get(flag, "1")]
            r = self.print_config(*args)
            self.assertNotIn("unknown flag", r.stderr)
            refused = [why for name, why in TORCHRUN_REFUSED.items()
                       if "--" + name in [o.replace("_", "-") for o in options]]
            if refused:  # a torchrun 2.x flag launch refuses with its reason
                self.assertEqual(r.returncode, 2, f"{args}: {r.stderr}")
                self.assertIn("not supported", r.stderr)
                self.assertIn(refused[0], r.stderr)
            else:
                self.assertEqual(r.returncode, 0, f"{args}: {r.stderr}")

    def test_newer_torchrun_flags_parse_or_say_why_not(self):
        for flag, value in TORCHRUN_NEW_FLAGS.items():
            args = ["--" + flag] + ([] if value is None else [value])
            r = self.print_config(*args)
            self.assertEqual(r.returncode, 0, f"{args}: {r.stderr}")
        for flag, why in TORCHRUN_REFUSED.items():
            r = self.print_config("--" + flag, "x")
            self.assertEqual(r.returncode, 2, flag)
            self.assertIn(f"--{flag.replace('-', '_')}", r.stderr.replace("-", "_").replace("__", "--"))
            self.assertIn("not supported", r.stderr)
            self.assertIn(why, r.stderr)
        # Their meaning: --shutdown-timeout is the grace period, --local-addr the address used
        # towards the rendezvous.
        r = self.print_config("--shutdown-timeout", "12", "--local-addr", "127.0.0.5")
        self.assertRegex(r.stdout, r"stop_grace: 12\s+# flag --stop_grace/--shutdown_timeout")
        self.assertRegex(r.stdout, r"rdzv_local_addr: 127.0.0.5\s+# flag")
        r = self.print_config("--signals-to-handle", "SIGTERM,SIGBUS")
        self.assertEqual(r.returncode, 2)
        self.assertIn("'SIGBUS' cannot be chosen", r.stderr)

    def test_every_accelerate_flag_parses(self):
        cfg = os.path.join(tmpdir(), "c.yaml")
        with open(cfg, "w") as f:
            f.write(MINIMAL_CONFIG)
        samples = {"config_file": cfg, "mixed_precision": "bf16", "gpu_ids": "all",
                   "main_process_ip": "127.0.0.1", "log_dir": tmpdir(), "rdzv_conf": "join_timeout=9",
                   "rdzv_backend": "static", "tee": "0", "fp8_override_linear_precision": "0,0,0",
                   "machine_rank": "0"}
        for flag in ACCELERATE_VALUE_FLAGS:
            for spelling in (flag, flag.replace("_", "-")):
                r = self.print_config("--" + spelling, samples.get(flag, "1"))
                self.assertEqual(r.returncode, 0, f"--{spelling}: {r.stderr}")
        for flag in ACCELERATE_SWITCHES:
            args = ["-" + flag if len(flag) == 1 else "--" + flag]
            if flag in ("module", "m"):
                continue  # needs a Python program; covered by test_launch.py
            r = self.print_config(*args)
            self.assertEqual(r.returncode, 0, f"{args}: {r.stderr}")
        for flag, why in ACCELERATE_REFUSED.items():
            r = self.print_config("--" + flag, *([] if flag == "tpu" else ["hosts"]))
            self.assertEqual(r.returncode, 2, flag)
            self.assertIn(why, r.stderr)

    def test_settings_without_effect_are_named_once_only_when_not_default(self):
        r = self.print_config("--tpu_use_sudo", "--main_training_function", "train",
                              "--downcast_bf16", "--quiet", "--main_training_function", "main")
        self.assertEqual(r.returncode, 0, r.stderr)
        warnings = [l for l in r.stderr.splitlines() if "no effect" in l]
        self.assertEqual(len(warnings), 1, warnings)
        self.assertIn("tpu_use_sudo (TPU)", warnings[0])
        self.assertIn("downcast_bf16 (TPU)", warnings[0])
        self.assertNotIn("quiet", warnings[0])

    def test_contradictions_torchrun_and_accelerate_refuse(self):
        r = launch("--cpu", "--multi_gpu", "--", "/bin/true")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--cpu and --multi_gpu", r.stderr)
        r = launch("-m", "--no_python", "json.tool")
        self.assertEqual(r.returncode, 2)
        self.assertIn("cannot go with --no_python", r.stderr)


class TorchrunBehaviour(unittest.TestCase):
    def test_default_is_one_worker_as_torchrun(self):
        r = launch("--", "/bin/sh", "-c", "echo size $LOCAL_WORLD_SIZE", env={"HF_HOME": tmpdir()})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.count("size 1"), 1, r.stdout)

    def test_script_arguments_after_dashdash_and_scripts_without_py(self):
        d = tmpdir()
        script = os.path.join(d, "train")  # no .py, not executable: torchrun runs it with Python
        with open(script, "w") as f:
            f.write("import sys; print('args', sys.argv[1:])\n")
        r = launch("--python", SYSTEM_PYTHON, script, "a", "--", "--b")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("[rank 0]: args ['a', '--', '--b']", r.stdout)
        r = launch("--python", SYSTEM_PYTHON, "--run_path", script)
        self.assertIn("[rank 0]: args []", r.stdout)

    def test_virtual_local_rank(self):
        r = launch("--nproc_per_node", "2", "--virtual_local_rank", "--", "/bin/sh", "-c",
                   "echo ranks $RANK $LOCAL_RANK $LOCAL_WORLD_SIZE")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("[rank 0]: ranks 0 0 2", r.stdout)
        self.assertIn("[rank 1]: ranks 1 0 2", r.stdout)
        fake = os.path.abspath(os.path.join(os.path.dirname(LAUNCH), "..", "fake_nvml"))
        if not os.path.exists(os.path.join(fake, "libnvidia-ml.so.1")):
            self.skipTest(harness.needs_setup("the fake libnvidia-ml.so.1 (two GPUs) is not built"))
        # On GPUs each worker sees only the device its local rank picks, as cuda:0.
        r = launch("--nproc_per_node", "gpu", "--virtual_local_rank", "--", "/bin/sh", "-c",
                   "echo dev $LOCAL_RANK $CUDA_VISIBLE_DEVICES",
                   env={"LD_LIBRARY_PATH": fake, "CUDA_VISIBLE_DEVICES": "1,0"})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("[rank 0]: dev 0 1", r.stdout)
        self.assertIn("[rank 1]: dev 0 0", r.stdout)

    def test_error_file_of_a_record_decorated_script_is_quoted(self):
        # torch's @record writes the exception to TORCHELASTIC_ERROR_FILE; the report quotes it.
        # Python's json writes the emoji as a surrogate pair (\ud83d\ude00), which the agent
        # must decode as JSON does.
        d = tmpdir()
        script = os.path.join(d, "fail.py")
        with open(script, "w") as f:
            f.write("import os, time\n"
                    "from torch.distributed.elastic.multiprocessing.errors import record\n"
                    "def inner():\n"
                    "    raise ValueError('bad shard 42 \\U0001F600')\n"
                    "@record\n"
                    "def main():\n"
                    "    if os.environ['RANK'] == '1':\n"
                    "        inner()\n"
                    "    time.sleep(60)\n"
                    "main()\n")
        private_tmp = tmpdir()
        r = launch("--nproc_per_node", "2", "--python", SYSTEM_PYTHON, script,
                   env={"TMPDIR": private_tmp})
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("root cause: rank 1", r.stderr)
        self.assertIn("  error: ValueError: bad shard 42 \U0001F600\n", r.stderr)
        self.assertRegex(r.stderr, r"traceback \(from \S+rank_1\.error\.json\):")
        self.assertIn("in inner", r.stderr)
        self.assertEqual(os.listdir(private_tmp), [], "the private error directory was left")
        # With a log_dir the file stays beside the rank's logs, as torchrun keeps error.json.
        logs = tmpdir()
        r = launch("--nproc_per_node", "2", "--log_dir", logs, "--run_id", "j", "--python",
                   SYSTEM_PYTHON, script)
        self.assertEqual(r.returncode, 1, r.stderr)
        with open(os.path.join(logs, "j", "attempt_0", "rank_1.error.json")) as f:
            record = json.load(f)
        self.assertEqual(record["message"]["message"], "ValueError: bad shard 42 \U0001F600")
        # A worker that writes nothing there (no @record) is reported from its stderr.
        r = launch("--", "/bin/sh", "-c", "echo plain failure >&2; exit 4")
        self.assertEqual(r.returncode, 4)
        self.assertIn("    plain failure", r.stderr)
        self.assertNotIn("  error:", r.stderr)


class AccelerateBehaviour(unittest.TestCase):
    SHOW = ("import os; print('ACC ' + ' '.join(f'{k}={os.environ[k]}' for k in sorted(os.environ) "
            "if k.startswith(('ACCELERATE_', 'FSDP_')) or k == 'OMP_NUM_THREADS'))")

    def acc_env(self, r):
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = [l for l in r.stdout.splitlines() if "]: ACC " in l]
        self.assertTrue(lines, r.stdout)
        return dict(kv.split("=", 1) for kv in lines[0].split("ACC ", 1)[1].split())

    def test_accelerate_config_sections_reach_the_script(self):
        hf = tmpdir()
        path = os.path.join(hf, "accelerate", "default_config.yaml")
        os.makedirs(os.path.dirname(path))
        with open(path, "w") as f:  # as `accelerate config` writes an FSDP setup
            f.write("compute_environment: LOCAL_MACHINE\ndebug: true\ndistributed_type: FSDP\n"
                    "downcast_bf16: 'no'\nenable_cpu_affinity: false\n"
                    "fsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
                    "  fsdp_backward_prefetch: BACKWARD_PRE\n  fsdp_cpu_ram_efficient_loading: true\n"
                    "  fsdp_forward_prefetch: false\n  fsdp_offload_params: false\n"
                    "  fsdp_sharding_strategy: FULL_SHARD\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
                    "  fsdp_sync_module_states: true\n  fsdp_use_orig_params: true\n"
                    "machine_rank: 0\nmain_training_function: main\nmixed_precision: bf16\n"
                    "num_machines: 1\nnum_processes: 2\nrdzv_backend: static\nsame_network: true\n"
                    "tpu_env: []\ntpu_use_cluster: false\ntpu_use_sudo: false\nuse_cpu: false\n")
        r = launch("--python", SYSTEM_PYTHON, "--", SYSTEM_PYTHON, "-c", self.SHOW,
                   env={"HF_HOME": hf})
        env = self.acc_env(r)
        self.assertNotIn("no effect", r.stderr)  # every value above is a default or has effect
        self.assertEqual(env["ACCELERATE_USE_FSDP"], "true")
        self.assertEqual(env["FSDP_AUTO_WRAP_POLICY"], "TRANSFORMER_BASED_WRAP")
        self.assertEqual(env["FSDP_STATE_DICT_TYPE"], "SHARDED_STATE_DICT")
        self.assertEqual(env["FSDP_OFFLOAD_PARAMS"], "false")
        self.assertEqual(env["ACCELERATE_MIXED_PRECISION"], "bf16")
        self.assertEqual(env["ACCELERATE_DEBUG_MODE"], "true")
        self.assertEqual(env["ACCELERATE_DYNAMO_BACKEND"], "NO")
        self.assertEqual(r.stdout.count("]: ACC "), 2)

    def test_accelerate_flags_reach_the_script(self):
        r = launch("--num_processes", "1", "--use_deepspeed", "--zero_stage", "2",
                   "--offload_optimizer_device", "CPU", "--gradient_accumulation_steps", "8",
                   "--", SYSTEM_PYTHON, "-c", self.SHOW, env={"HF_HOME": tmpdir()})
        env = self.acc_env(r)
        self.assertEqual(env["ACCELERATE_USE_DEEPSPEED"], "true")
        self.assertEqual(env["ACCELERATE_DEEPSPEED_ZERO_STAGE"], "2")
        self.assertEqual(env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"], "cpu")
        self.assertEqual(env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"], "8")
        self.assertNotIn("ACCELERATE_DYNAMO_BACKEND", env)
        r = launch("--num_processes", "1", "--dynamo_backend", "inductor", "--dynamo_use_dynamic",
                   "--num_cpu_threads_per_process", "3", "--enable_cpu_affinity", "--", SYSTEM_PYTHON,
                   "-c", self.SHOW, env={"HF_HOME": tmpdir()})
        env = self.acc_env(r)
        self.assertEqual(env["ACCELERATE_DYNAMO_BACKEND"], "INDUCTOR")
        self.assertEqual(env["ACCELERATE_DYNAMO_USE_DYNAMIC"], "True")
        self.assertEqual(env["ACCELERATE_DYNAMO_USE_FULLGRAPH"], "False")
        self.assertEqual(env["OMP_NUM_THREADS"], "3")
        self.assertEqual(env["ACCELERATE_CPU_AFFINITY"], "1")

    def test_fsdp_and_deepspeed_settings_choose_the_trainers_sharding(self):
        cfg = os.path.join(tmpdir(), "fsdp.yaml")
        with open(cfg, "w") as f:  # an `accelerate config` FSDP file, plus a train: section
            f.write("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\n"
                    "fsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
                    "  fsdp_offload_params: false\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n"
                    "  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
                    "num_machines: 1\nnum_processes: 2\n"
                    "train:\n  max_steps: 2\n")
        r = launch("--print_config", cfg)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRegex(r.stdout, r"train\.parallel\.mode: zero\s+# derived \(distributed_type: "
                                   r"FSDP at .*fsdp\.yaml:2, fsdp_sharding_strategy: SHARD_GRAD_OP")
        self.assertRegex(r.stdout, r"train\.parallel\.zero_stage: 2\s+# derived")
        self.assertIn("fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP", r.stdout)
        self.assertNotIn("fsdp_offload_params", r.stdout)  # false asks for nothing
        # accelerate launch's flags over the file: DeepSpeed's stage 1 wins over FSDP's...
        r = launch("--print_config", "--use_deepspeed", "--zero_stage", "1", "--multi_gpu", cfg)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRegex(r.stdout, r"train\.parallel\.zero_stage: 1\s+# derived \(use_deepspeed")
        # ...and train's own flag over both.
        r = launch("--print_config", cfg, "--", "--parallel.mode", "ddp")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRegex(r.stdout, r"train\.parallel\.mode: ddp\s+# flag")


if __name__ == "__main__":
    unittest.main()
