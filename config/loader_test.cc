#include "config/loader.h"
#include "config/train_keys.h"

#include "base/files.h"
#include "base/test_util.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

namespace launch::config {
namespace {

Status Load(const std::string& yaml, LaunchConfig* cfg) {
  return LoadYamlString(yaml, "train.yaml", cfg);
}

// The train: section's cross-field rules run once every layer is in (ValidateTrain).
Status LoadValid(const std::string& yaml, LaunchConfig* cfg) {
  Status s = LoadYamlString(yaml, "train.yaml", cfg);
  return s.ok() ? ValidateTrain(cfg) : s;
}

TEST_CASE("AccelerateFileLoadsWithWarningForIgnoredKeys") {
  LaunchConfig cfg;
  Status s = Load(
      "compute_environment: LOCAL_MACHINE\n"
      "distributed_type: MULTI_CPU\n"
      "num_processes: 4\n"
      "num_machines: 2\n"
      "machine_rank: 1\n"
      "main_process_ip: 10.1.2.3\n"
      "main_process_port: 29501\n"
      "mixed_precision: 'no'\n"
      "gpu_ids: all\n"
      "downcast_bf16: 'no'\n"
      "use_cpu: true\n",
      &cfg);
  REQUIRE(s.ok());
  CHECK(cfg.distributed_type == DistributedType::kMultiCpu);
  CHECK(cfg.num_processes == 4);
  CHECK(cfg.min_nodes == 2);
  CHECK(cfg.machine_rank == 1);
  CHECK(cfg.main_process_ip == "10.1.2.3");
  CHECK(cfg.main_process_port == 29501);
  CHECK(cfg.origins["num_processes"].ToString() == "train.yaml:3");
  REQUIRE(Validate(&cfg).ok());
  CHECK(cfg.warnings.empty());       // LOCAL_MACHINE and downcast_bf16 'no' ask for nothing
  CHECK(cfg.nproc_per_node == "2");  // 4 total over 2 machines
}

TEST_CASE("UnknownKeyNamesLineAndSuggests") {
  LaunchConfig cfg;
  Status s = Load("max_restarts: 1\nnprocs: 2\n", &cfg);
  CHECK(s.code() == Status::Code::kInvalidConfig);
  CHECK(s.message() == "train.yaml:2: unknown key 'nprocs' (did you mean 'nproc_per_node'?)");
}

TEST_CASE("BadEnumInTrainSectionNamesPathAndSuggests") {
  LaunchConfig cfg;
  Status s = Load("train:\n  seed: 1\n  parallel:\n    mode: dpp\n", &cfg);
  CHECK(s.message() ==
        "train.yaml:4: train.parallel.mode: 'dpp' is not one of none, dp, ddp, pipeline, zero (did "
        "you mean 'ddp'?)");
}

TEST_CASE("WrongTypesAndRangesAreErrors") {
  LaunchConfig cfg;
  CHECK(Load("num_processes: two\n", &cfg).message() ==
        "train.yaml:1: num_processes: expected an integer, got 'two'");
  CHECK(Load("main_process_port: 70000\n", &cfg).message() ==
        "train.yaml:1: main_process_port: port 70000 is out of range 0..65535");
  CHECK(Load("train:\n  batch_size: 0\n", &cfg).message() ==
        "train.yaml:2: train.batch_size: value 0 is out of range [1, 16777216]");
  CHECK(Load("train:\n  model: {type: mlp, layers: [4, x]}\n", &cfg)
            .message()
            .find("train.yaml:2: train.model.layers: expected an integer, got 'x'") == 0);
  CHECK(Load("train:\n  optimizr: {lr: 1}\n", &cfg).message() ==
        "train.yaml:2: train.optimizr: unknown key (did you mean 'optimizer'?)");
  CHECK(Load("num_processes: [1, 2]\n", &cfg).message() ==
        "train.yaml:1: num_processes: expected a single value");
}

TEST_CASE("SyntaxErrorNamesLine") {
  LaunchConfig cfg;
  Status s = Load("a: 1\nb: [1, 2\n", &cfg);
  CHECK(s.code() == Status::Code::kInvalidConfig);
  CHECK(s.message().rfind("train.yaml:", 0) == 0);
}

TEST_CASE("PrecedenceFlagOverEnvironmentOverYaml") {
  LaunchConfig cfg;
  REQUIRE(Load("max_restarts: 1\nrole: trainer\nrun_id: fromyaml\n", &cfg).ok());
  REQUIRE(ApplyEnvironment({{"LAUNCH_MAX_RESTARTS", "2"}, {"PET_RDZV_ID", "fromenv"}}, &cfg).ok());
  CHECK(cfg.max_restarts == 2);
  CHECK(cfg.run_id == "fromenv");
  CHECK(cfg.origins["max_restarts"].ToString() == "environment LAUNCH_MAX_RESTARTS");
  REQUIRE(
      ApplySetting("max_restarts", "3", Origin{Origin::Kind::kFlag, "--max_restarts"}, &cfg).ok());
  CHECK(cfg.max_restarts == 3);
  CHECK(cfg.role == "trainer");
  std::string printed = FormatConfig(cfg);
  CHECK(printed.find("max_restarts: 3") != std::string::npos);
  CHECK(printed.find("# flag --max_restarts") != std::string::npos);
  CHECK(printed.find("# train.yaml:2") != std::string::npos);
}

TEST_CASE("FlagErrorsNameTheFlag") {
  LaunchConfig cfg;
  Status s = ApplySetting("nnodes", "3:2", Origin{Origin::Kind::kFlag, "--nnodes"}, &cfg);
  CHECK(s.message() == "--nnodes: expected 1 <= MIN <= MAX <= 65536, got '3:2'");
  s = ApplySetting("tee", "7", Origin{Origin::Kind::kFlag, "--tee"}, &cfg);
  CHECK(s.message().rfind("--tee: expected 0 (none)", 0) == 0);
}

TEST_CASE("StallTimeoutDefaultsToHalfAnHourAcceptsZeroAndRefusesNegatives") {
  LaunchConfig cfg;
  CHECK(cfg.stall_timeout_s == 1800);
  REQUIRE(ApplySetting("stall_timeout", "0", Origin{Origin::Kind::kFlag, "--stall_timeout"}, &cfg)
              .ok());
  CHECK(cfg.stall_timeout_s == 0);
  REQUIRE(ApplySetting("stall_timeout", "5", Origin{Origin::Kind::kFlag, "--stall_timeout"}, &cfg)
              .ok());
  CHECK(cfg.stall_timeout_s == 5);
  Status s =
      ApplySetting("stall_timeout", "-1", Origin{Origin::Kind::kFlag, "--stall_timeout"}, &cfg);
  CHECK(s.message() == "--stall_timeout: expected a duration in seconds >= 0, got -1");
}

TEST_CASE("ElasticNodesAndEndpoints") {
  LaunchConfig cfg;
  REQUIRE(Load("nnodes: 2:4\nrdzv_endpoint: '[::1]:29400'\n", &cfg).ok());
  CHECK(cfg.min_nodes == 2);
  CHECK(cfg.max_nodes == 4);
  CHECK(cfg.main_process_ip == "::1");
  CHECK(cfg.main_process_port == 29400);
}

TEST_CASE("EtcdBackendTakesTheClustersEndpointsFromRdzvEndpoint") {
  auto flags = [](std::vector<std::pair<std::string, std::string>> settings, LaunchConfig* cfg) {
    for (const auto& [key, value] : settings) {
      Status s = ApplySetting(key, value, Origin{Origin::Kind::kFlag, "--" + key}, cfg);
      if (!s.ok()) return s;
    }
    return Validate(cfg);
  };
  LaunchConfig cfg;
  REQUIRE(flags({{"nnodes", "3"},
                 {"rdzv_backend", "etcd-v2"},
                 {"rdzv_endpoint", "a:2379, b:2379,[::1]:2379"}},
                &cfg)
              .ok());
  CHECK(cfg.rdzv_backend == "etcd");
  CHECK(cfg.etcd_endpoints == std::vector<std::string>{"a:2379", "b:2379", "[::1]:2379"});
  LaunchConfig one;
  REQUIRE(flags({{"rdzv_backend", "etcd"}, {"rdzv_endpoint", "e:2379"}}, &one).ok());
  CHECK(one.etcd_endpoints == std::vector<std::string>{"e:2379"});
  LaunchConfig builtin;
  REQUIRE(flags({{"rdzv_backend", "static"}, {"rdzv_endpoint", "h:29400"}}, &builtin).ok());
  CHECK(builtin.rdzv_backend == "c10d");
  CHECK(builtin.main_process_ip == "h");
  CHECK(builtin.etcd_endpoints.empty());
  LaunchConfig bad;
  CHECK(launch::testing::Contains(flags({{"rdzv_backend", "zookeeper"}}, &bad).message(),
                                  "rdzv_backend 'zookeeper': expected c10d or static"));
  LaunchConfig none;
  CHECK(launch::testing::Contains(flags({{"rdzv_backend", "etcd"}}, &none).message(),
                                  "rdzv_backend etcd needs rdzv_endpoint"));
  LaunchConfig list;
  CHECK(launch::testing::Contains(flags({{"rdzv_endpoint", "a:1,b:2"}}, &list).message(),
                                  "only rdzv_backend etcd takes a list"));
  LaunchConfig half;
  CHECK(!flags({{"rdzv_endpoint", "a:1,b"}}, &half).ok());
  // In the YAML too (accelerate's files say `rdzv_backend: static`).
  LaunchConfig yaml;
  REQUIRE(Load("rdzv_backend: etcd\nrdzv_endpoint: 'a:2379,b:2379'\n", &yaml).ok());
  REQUIRE(Validate(&yaml).ok());
  CHECK(yaml.etcd_endpoints.size() == 2);
}

TEST_CASE("StreamSpecsPerRank") {
  LaunchConfig cfg;
  REQUIRE(
      ApplySetting("redirects", "0:1,1:3", Origin{Origin::Kind::kFlag, "--redirects"}, &cfg).ok());
  CHECK(cfg.redirects.For(0) == 1);
  CHECK(cfg.redirects.For(1) == 3);
  CHECK(cfg.redirects.For(2) == 0);
}

TEST_CASE("NumProcessesAndNprocPerNodeFromSameLayerMustAgree") {
  LaunchConfig cfg;
  REQUIRE(Load("num_processes: 3\nnproc_per_node: 2\n", &cfg).ok());
  Status s = Validate(&cfg);
  CHECK(s.message().find("num_processes 3 disagrees with nproc_per_node 2") != std::string::npos);

  LaunchConfig cfg2;
  REQUIRE(Load("num_processes: 3\n", &cfg2).ok());
  REQUIRE(
      ApplySetting("nproc_per_node", "2", Origin{Origin::Kind::kFlag, "--nproc_per_node"}, &cfg2)
          .ok());
  CHECK(Validate(&cfg2).ok());  // the flag wins
  CHECK(cfg2.nproc_per_node == "2");
}

TEST_CASE("TrainSectionDefaultsAndValues") {
  LaunchConfig cfg;
  REQUIRE(Load("train:\n"
               "  seed: 7\n"
               "  model: {type: transformer, vocab: bytes, d_model: 64, layers: 2, heads: 4, "
               "context: 32}\n"
               "  data: {type: text, path: /usr/share/common-licenses/GPL-3}\n"
               "  optimizer: {type: sgd, lr: 0.1, momentum: 0.9}\n"
               "  parallel: {mode: pipeline, stages: 2, microbatches: 4, schedule: gpipe}\n",
               &cfg)
              .ok());
  CHECK(cfg.train.present);
  CHECK(cfg.train.seed == 7);
  CHECK(cfg.train.model.type == ModelType::kTransformer);
  CHECK(cfg.train.model.transformer_layers == 2);
  CHECK(cfg.train.optimizer.weight_decay == 0.0);
  CHECK(cfg.train.parallel.schedule == PipelineSchedule::kGPipe);
  LaunchConfig bad;
  CHECK(LoadValid("train:\n  parallel: {mode: pipeline, stages: 4, microbatches: 2}\n", &bad)
            .message()
            .find("1F1B needs at least as many micro-batches (2) as stages (4)") !=
        std::string::npos);
  LaunchConfig ts;
  REQUIRE(Load("train:\n  model: {torchscript: m.pt}\n", &ts).ok());
  CHECK(ts.train.model.type == ModelType::kTorchScript);
  CHECK(ts.train.model.torchscript_path == "m.pt");
}

TEST_CASE("StagesAndTensorAreLayoutDegreesThatComposeWithEveryDataStrategy") {
  // `mode` is the data axis' strategy; stages above 1 make every replica a pipeline.
  LaunchConfig zero;
  REQUIRE(Load("train:\n"
               "  parallel: {mode: zero, zero_stage: 3, stages: 2, microbatches: 2}\n",
               &zero)
              .ok());
  CHECK(zero.train.parallel.pipelined());
  CHECK(zero.train.parallel.data_mode() == ParallelMode::kZero);
  CHECK(ValidateTrain(&zero, 8).ok());
  // Tensor parallelism splits the transformer, with any data strategy.
  LaunchConfig split;
  REQUIRE(Load("train:\n  model: {type: transformer}\n"
               "  data: {type: text, path: /usr/share/common-licenses/GPL-3}\n"
               "  parallel: {mode: zero, zero_stage: 3, tensor: 2}\n",
               &split)
              .ok());
  CHECK(split.train.parallel.tensor == 2);
  CHECK(ValidateTrain(&split, 8).ok());
  // stages x tensor must divide the world: the message names the keys and where they are.
  const std::string message = ValidateTrain(&split, 5).message();
  CHECK(message.find("train.yaml:4") != std::string::npos);
  CHECK(
      message.find(
          "train.parallel.tensor: stages x tensor x context (1 x 2 x 1) does not divide the world "
          "size 5") != std::string::npos);
  // Inside pipeline stages too (tensor 2 x data 2 x stages 2); not for a model without split
  // layers: said, not ignored.
  split.train.parallel.stages = 2;
  CHECK(ValidateTrain(&split, 8).ok());
  zero.train.parallel.tensor = 2;
  CHECK(ValidateTrain(&zero, 8).message().find("model.type mlp has no tensor-parallel layers") !=
        std::string::npos);
  // `mode: pipeline` keeps its meaning: ddp over pipeline replicas.
  LaunchConfig pipeline;
  REQUIRE(
      Load("train:\n  parallel: {mode: pipeline, stages: 2, microbatches: 2}\n", &pipeline).ok());
  CHECK(pipeline.train.parallel.data_mode() == ParallelMode::kDdp);
  CHECK(ValidateTrain(&pipeline, 4).ok());
  // dp drives replicas inside one process: no other axis.
  LaunchConfig dp;
  REQUIRE(Load("train:\n  parallel: {mode: dp, stages: 2}\n", &dp).ok());
  CHECK(ValidateTrain(&dp).message().find("train.parallel.mode: dp runs its replicas in one "
                                          "process") != std::string::npos);
  LaunchConfig range;
  CHECK(Load("train:\n  parallel: {tensor: 0}\n", &range).message().find("parallel.tensor") !=
        std::string::npos);
}

TEST_CASE("ContextSplitsTheTransformersSequencesUnderDdpOrZeroAndSaysWhyNotElsewhere") {
  LaunchConfig cp;
  REQUIRE(Load("train:\n  model: {type: transformer, heads: 4, context: 64}\n"
               "  data: {type: text, path: /usr/share/common-licenses/GPL-3, context: 16}\n"
               "  parallel: {context: 2, tensor: 2, sequence_parallel: true}\n",
               &cp)
              .ok());
  CHECK(cp.train.parallel.context == 2);
  CHECK(ValidateTrain(&cp, 8).ok());  // tensor 2 x context 2 x data 2
  cp.train.parallel.mode = ParallelMode::kZero;
  CHECK(ValidateTrain(&cp, 8).ok());
  cp.train.parallel.mode = ParallelMode::kDdp;
  const auto message = [&cp](int world) { return ValidateTrain(&cp, world).message(); };
  CHECK(message(6) ==
        "train.yaml:4: train.parallel.context: stages x tensor x context (1 x 2 x 2) does not "
        "divide the world size 6 (world = tensor x context x data x stages)");
  cp.train.parallel.context = 4;  // 4 heads over tensor 2 x context 4
  CHECK(message(8).find("train.parallel.context: tensor x context (2 x 4) does not divide "
                        "model.heads 4") != std::string::npos);
  cp.train.parallel.context = 2;
  cp.train.data.context = 10;  // 10 tokens in context 2 x tensor 2 parts
  CHECK(message(8).find("a sequence of 10 tokens (data.context, else model.context) does not "
                        "split into 4 equal parts (context x tensor, with sequence_parallel)") !=
        std::string::npos);
  cp.train.data.context = 16;
  cp.train.parallel.mode = ParallelMode::kNone;
  CHECK(message(8).find("train.parallel.context: splits each sequence over ranks that average "
                        "their gradients every step; it combines with parallel.mode ddp or "
                        "zero, not none") != std::string::npos);
  cp.train.parallel.mode = ParallelMode::kDdp;
  cp.train.local_sgd_steps = 4;
  CHECK(message(8).find("Local SGD lets replicas drift") != std::string::npos);
  cp.train.local_sgd_steps = 0;
  cp.train.parallel.stages = 2;
  CHECK(message(16).find("train.parallel.context: does not combine with pipeline stages") !=
        std::string::npos);
  cp.train.parallel.stages = 1;
  cp.train.model.type = ModelType::kCnn;
  CHECK(message(8).find("model.type cnn has none") != std::string::npos);
  LaunchConfig range;
  CHECK(Load("train:\n  parallel: {context: 0}\n", &range).message().find("parallel.context") !=
        std::string::npos);
}

TEST_CASE("ImageDataCnnLossAndOutputKeys") {
  LaunchConfig cfg;
  REQUIRE(Load("train:\n"
               "  model: {type: cnn, channels: [8, 16, 32], hidden: 0, classes: 4}\n"
               "  data: {type: idx, augment: {crop_padding: 2, flip: true}, shuffle: false}\n"
               "  loss: {type: cross_entropy, label_smoothing: 0.1, class_weights: [1, 2, 1, 1]}\n"
               "  optimizer: {no_decay: [bias]}\n"
               "  parallel: {mode: ddp, find_unused_parameters: true}\n"
               "  save_model: checkpoints\n",
               &cfg)
              .ok());
  REQUIRE(ValidateTrain(&cfg).ok());
  const TrainConfig& t = cfg.train;
  CHECK(t.model.type == ModelType::kCnn);
  CHECK(t.model.cnn_channels == std::vector<int64_t>{8, 16, 32});
  CHECK(t.model.cnn_hidden == 0);
  CHECK(t.data.type == DataType::kIdx);
  CHECK(t.data.path == kFashionMnistDir);  // the default directory
  CHECK(t.data.crop_padding == 2);
  CHECK(t.data.flip);
  CHECK_FALSE(t.data.shuffle);
  CHECK(t.loss.label_smoothing == 0.1);
  CHECK(t.loss.class_weights.size() == 4);
  CHECK(t.optimizer.no_decay == std::vector<std::string>{"bias"});
  CHECK(t.parallel.find_unused_parameters);
  CHECK(t.save_model == SaveModel::kCheckpoints);
  CHECK(TrainConfig().optimizer.no_decay == std::vector<std::string>{"bias", "norm"});

  LaunchConfig ts;
  REQUIRE(Load("train:\n  model: {torchscript: m.pt, inputs: [input, target], outputs: {logits: 1, "
               "loss: 0}}\n",
               &ts)
              .ok());
  CHECK(ts.train.model.inputs == std::vector<std::string>{"input", "target"});
  CHECK(ts.train.model.output_logits == "1");
  CHECK(ts.train.model.output_loss == "0");
}

TEST_CASE("BadImageModelAndLossKeysAreNamed") {
  // A fresh config per case: a failed load leaves what it had read.
  auto error = [](const std::string& yaml) {
    LaunchConfig cfg;
    return LoadValid(yaml, &cfg).message();
  };
  CHECK(error("train:\n  model: {torchscript: m.pt, inputs: [input, mask]}\n") ==
        "train.yaml:2: train.model.inputs: 'mask' is not a batch field; fields are input, target");
  CHECK(error("train:\n  model: {torchscript: m.pt, outputs: {logit: 0}}\n") ==
        "train.yaml:2: train.model.outputs.logit: unknown key (did you mean 'logits'?)");
  CHECK(error("train:\n  model: {type: cnn, input: [28, 28]}\n") ==
        "train.yaml:2: train.model.input: expected [channels, height, width], e.g. [1, 28, 28]");
  CHECK(error("train:\n  model: {type: cnn, channels: [4, 4, 4, 4, 4, 4]}\n")
            .find("train.model.channels: 6 blocks halve a 28x28 image to nothing") !=
        std::string::npos);
  CHECK(error("train:\n  model: {type: mlp, channels: [4]}\n") ==
        "train.yaml:2: train.model.channels: applies only with model.type cnn");
  CHECK(error("train:\n  loss: {type: mse, label_smoothing: 0.1}\n") ==
        "train.yaml:2: train.loss.type: label_smoothing, ignore_index and class_weights are "
        "cross_entropy options, not mse");
  CHECK(
      error("train:\n  loss: {type: hinge}\n")
          .find(
              "train.loss.type: 'hinge' is not one of auto, cross_entropy, mse, bce_with_logits") !=
      std::string::npos);
  CHECK(error("train:\n  data: {type: idx, path: /nonexistent}\n") ==
        "train.yaml:2: train.data.path: '/nonexistent' is not a directory of IDX files");
  CHECK(error("train:\n  model: {type: cnn}\n  parallel: {mode: pipeline, stages: 2}\n")
            .find("pipeline mode splits mlp, transformer or a list of TorchScript stages, not a "
                  "cnn") != std::string::npos);
  CHECK(error("train:\n  save_model: always\n")
            .find("train.save_model: 'always' is not one of end, checkpoints, never") !=
        std::string::npos);
}

TEST_CASE("TrajectorySettingsNameWhatShapesARunOnly") {
  LaunchConfig cfg;
  REQUIRE(Load("train:\n  output_dir: a\n  batch_size: 16\n  model: {type: cnn}\n"
               "  data: {type: idx}\n  resume_allow_changes: true\n",
               &cfg)
              .ok());
  CHECK(cfg.train.resume_allow_changes);
  auto settings = TrajectorySettings(cfg.train);
  auto value = [&](const std::string& key) -> std::string {
    for (const auto& [k, v] : settings)
      if (k == key) return v;
    return "(absent)";
  };
  CHECK(value("train.batch_size") == "16");
  CHECK(value("train.model.channels") == "[16, 32]");
  CHECK(value("train.data.augment.crop_padding") == "0");
  CHECK(value("train.data.augment.flip") == "false");
  CHECK(value("train.optimizer.no_decay") == "[bias, norm]");
  CHECK(value("train.model.layers") == "(absent)");  // an MLP key, not this model's
  CHECK(value("train.output_dir") == "(absent)");    // where outputs go changes no weights
  CHECK(value("train.max_steps") == "(absent)");     // added by the program when it matters
  // The same settings, in the same order, every time: ranks and restarts compare them.
  CHECK(settings == TrajectorySettings(cfg.train));
  // The layout is not among them (a checkpoint is re-cut for another); older checkpoints that
  // recorded it are compared without it.
  REQUIRE(Load("train:\n  model: {type: transformer, heads: 4}\n"
               "  parallel: {tensor: 2, stages: 2, microbatches: 4}\n",
               &cfg)
              .ok());
  for (const auto& [key, unused] : TrajectorySettings(cfg.train)) {
    CHECK(!FormerTrajectorySetting(key));
    const bool layout = key.rfind("train.parallel.", 0) == 0 && key != "train.parallel.mode";
    CHECK_FALSE(layout);
  }
  CHECK(FormerTrajectorySetting("train.parallel.tensor"));
  CHECK(!FormerTrajectorySetting("train.parallel.mode"));
}

TEST_CASE("MissingDataFileIsAnError") {
  LaunchConfig cfg;
  Status s = LoadValid("train:\n  data: {type: csv, path: /nonexistent.csv}\n", &cfg);
  CHECK(s.message() == "train.yaml:2: train.data.path: cannot read '/nonexistent.csv'");
}

}  // namespace
}  // namespace launch::config

namespace launch::config {
namespace {

TEST_CASE("OlderAccelerateFilesLoad") {
  LaunchConfig cfg;
  REQUIRE(LoadYamlString("compute_environment: LOCAL_MACHINE\n"
                         "distributed_type: MULTI_GPU\n"
                         "dynamo_backend: 'NO'\n"
                         "fp16: true\n"
                         "use_mps_device: false\n"
                         "num_processes: 2\n",
                         "old.yaml", &cfg)
              .ok());
  CHECK(cfg.mixed_precision == "fp16");
  CHECK(cfg.accelerate["dynamo_backend"] == "NO");
  REQUIRE(Validate(&cfg).ok());
  CHECK(cfg.warnings.empty());
}

TEST_CASE("AccelerateSectionsAreKeptForTheScriptAndInertValuesWarnOnce") {
  LaunchConfig cfg;
  REQUIRE(LoadYamlString("distributed_type: FSDP\n"
                         "fsdp_config:\n"
                         "  fsdp_sharding_strategy: SHARD_GRAD_OP\n"
                         "  offload_params: true\n"
                         "  transformer_layer_cls_to_wrap: [Block, Head]\n"
                         "dynamo_config:\n"
                         "  dynamo_backend: INDUCTOR\n"
                         "  mode: max-autotune\n"
                         "deepspeed_config: {zero_stage: 2, gradient_clipping: 1.0}\n"
                         "num_cpu_threads_per_process: 4\n"
                         "downcast_bf16: true\n"
                         "tpu_use_sudo: true\n"
                         "same_network: false\n"
                         "ipex_config: {ipex: false}\n"  // what accelerate writes on every CPU
                         "mpirun_config: {}\n"
                         "num_processes: 2\n",
                         "acc.yaml", &cfg)
              .ok());
  CHECK(cfg.distributed_type == DistributedType::kFsdp);
  CHECK(cfg.accelerate["fsdp_sharding_strategy"] == "SHARD_GRAD_OP");
  CHECK(cfg.accelerate["fsdp_offload_params"] == "true");
  CHECK(cfg.accelerate["fsdp_transformer_layer_cls_to_wrap"] == "Block,Head");
  CHECK(cfg.accelerate["dynamo_backend"] == "INDUCTOR");
  CHECK(cfg.accelerate["dynamo_mode"] == "max-autotune");
  CHECK(cfg.accelerate["zero_stage"] == "2");
  CHECK(cfg.accelerate["_deepspeed_config_fields"] == "zero_stage,gradient_clipping");
  CHECK(cfg.accelerate["num_cpu_threads_per_process"] == "4");
  REQUIRE(Validate(&cfg).ok());
  REQUIRE(cfg.warnings.size() == 1);
  CHECK(cfg.warnings[0] ==
        "these accelerate settings have no effect with launch: downcast_bf16 (acc.yaml), "
        "tpu_use_sudo (acc.yaml)");
  // A section that asks for something is named.
  LaunchConfig ipex;
  REQUIRE(LoadYamlString("ipex_config: {ipex: true}\nmpirun_config: {mpirun_hostfile: /h}\n",
                         "acc.yaml", &ipex)
              .ok());
  REQUIRE(Validate(&ipex).ok());
  REQUIRE(ipex.warnings.size() == 1);
  CHECK(ipex.warnings[0] ==
        "these accelerate settings have no effect with launch: ipex_config (acc.yaml), "
        "mpirun_config (acc.yaml)");
}

TEST_CASE("OneKeyTableServesFlagsEnvironmentAndRdzvConf") {
  // The same key validated the same way from every path.
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"join_timeout", "-1"}, {"rdzv_conf", "join_timeout=-1"}}) {
    LaunchConfig cfg;
    Status s = ApplySetting(key, value, Origin{Origin::Kind::kFlag, "--" + key}, &cfg);
    CHECK(s.code() == Status::Code::kInvalidConfig);
    CHECK(s.message().find("expected a duration in seconds > 0, got -1") != std::string::npos);
  }
  LaunchConfig yaml;
  Status s = LoadYamlString("rdzv_conf: {join_timeout: -1}\n", "r.yaml", &yaml);
  CHECK(s.message() ==
        "r.yaml:1: rdzv_conf.join_timeout: expected a duration in seconds > 0, got -1");
  LaunchConfig env;
  s = ApplyEnvironment({{"PET_RDZV_CONF", "join_timeout=-1"}}, &env);
  CHECK(s.message().find("environment PET_RDZV_CONF: join_timeout: expected a duration") == 0);

  // torchrun's keep-alive pair becomes heartbeat_timeout; the origin is shown under rdzv_conf.
  LaunchConfig cfg;
  REQUIRE(ApplySetting("rdzv_conf", "keep_alive_interval=2,keep_alive_max_attempt=4,read_timeout=9",
                       Origin{Origin::Kind::kFlag, "--rdzv_conf"}, &cfg)
              .ok());
  CHECK(cfg.rdzv_conf.heartbeat_timeout_s == 8);
  CHECK(cfg.origins["rdzv_conf.heartbeat_timeout"].ToString() == "flag --rdzv_conf");
  REQUIRE(cfg.warnings.size() == 1);
  CHECK(cfg.warnings[0].find("read_timeout '9' has no effect") != std::string::npos);
  Status bad =
      ApplySetting("rdzv_conf", "join_timout=5", Origin{Origin::Kind::kFlag, "--rdzv_conf"}, &cfg);
  CHECK(bad.message() == "--rdzv_conf: unknown key 'join_timout' (did you mean 'join_timeout'?)");

  // A switch as a variable; a torchrun synonym; an accelerate flag kept for the script.
  LaunchConfig e2;
  REQUIRE(
      ApplyEnvironment(
          {{"PET_MODULE", "1"}, {"PET_SHUTDOWN_TIMEOUT", "7"}, {"LAUNCH_MULTI_GPU", "true"}}, &e2)
          .ok());
  CHECK(e2.run_module);
  CHECK(e2.stop_grace_s == 7);
  CHECK(e2.distributed_type == DistributedType::kMultiGpu);
  REQUIRE(ApplySetting("zero_stage", "3", Origin{Origin::Kind::kFlag, "--zero_stage"}, &e2).ok());
  CHECK(e2.accelerate["zero_stage"] == "3");
  CHECK(ApplySetting("logs_specs", "x", Origin{Origin::Kind::kFlag, "--logs_specs"}, &e2)
            .message()
            .find("--logs_specs: not supported: launch has no Python LogsSpecs") == 0);
}

// ---- accelerate's FSDP and DeepSpeed settings drive the built-in trainer's sharding.

struct Mapped {
  ParallelMode mode;
  int zero_stage;
};

// An accelerate file with a train: section, validated as launch does.
StatusOr<LaunchConfig> Resolve(const std::string& accelerate_part) {
  LaunchConfig cfg;
  Status s = LoadYamlString(accelerate_part + "train:\n  max_steps: 1\n", "acc.yaml", &cfg);
  if (s.ok()) s = Validate(&cfg);
  if (!s.ok()) return s;
  return cfg;
}

TEST_CASE("AcceleratesTensorParallelSizeIsTheTrainersTensorDegree") {
  const std::string train =
      "num_processes: 4\ntrain:\n  model: {type: transformer}\n"
      "  data: {type: text, path: /usr/share/common-licenses/GPL-3}\n";
  auto resolve = [&](const std::string& text) -> StatusOr<LaunchConfig> {
    LaunchConfig cfg;
    Status s = LoadYamlString(text, "acc.yaml", &cfg);
    if (s.ok()) s = Validate(&cfg);
    if (!s.ok()) return s;
    return cfg;
  };
  StatusOr<LaunchConfig> cfg =
      resolve("parallelism_config:\n  parallelism_config_tp_size: 2\n" + train);
  REQUIRE(cfg.ok());
  CHECK(cfg->train.parallel.tensor == 2);
  CHECK(cfg->origins["train.parallel.tensor"].ToString() ==
        "derived (parallelism_config_tp_size: 2 at acc.yaml:2)");
  cfg = resolve("parallelism_config:\n  parallelism_config_tp_size: 2\n" + train +
                "  parallel: {tensor: 4}\n");
  // The same layer saying two things is refused, naming both.
  REQUIRE_FALSE(cfg.ok());
  CHECK(cfg.status().message().find("train.parallel.tensor 4 disagrees with "
                                    "parallelism_config_tp_size 2") != std::string::npos);
}

TEST_CASE("FsdpShardingStrategiesMapOntoZeroStagesOrDdp") {
  const std::vector<std::pair<std::string, Mapped>> cases = {
      {"fsdp_config: {fsdp_sharding_strategy: FULL_SHARD}\n", {ParallelMode::kZero, 3}},
      {"fsdp_config: {fsdp_sharding_strategy: 1}\n", {ParallelMode::kZero, 3}},
      {"fsdp_config: {sharding_strategy: SHARD_GRAD_OP}\n", {ParallelMode::kZero, 2}},
      {"fsdp_config: {fsdp_sharding_strategy: 2}\n", {ParallelMode::kZero, 2}},
      {"fsdp_config: {fsdp_sharding_strategy: NO_SHARD}\n", {ParallelMode::kDdp, 0}},
      {"fsdp_config: {fsdp_sharding_strategy: 3}\n", {ParallelMode::kDdp, 0}},
      {"fsdp_config: {fsdp_sharding_strategy: HYBRID_SHARD}\n", {ParallelMode::kZero, 3}},
      {"fsdp_config: {fsdp_sharding_strategy: 4}\n", {ParallelMode::kZero, 3}},
      {"fsdp_config: {fsdp_sharding_strategy: HYBRID_SHARD_ZERO2}\n", {ParallelMode::kZero, 2}},
      {"fsdp_config: {fsdp_sharding_strategy: _HYBRID_SHARD_ZERO2}\n", {ParallelMode::kZero, 2}},
      {"fsdp_config: {fsdp_sharding_strategy: 5}\n", {ParallelMode::kZero, 2}},
      // Newer accelerate writes the strategy as fsdp_reshard_after_forward: a name for FSDP1,
      // a boolean for FSDP2.
      {"fsdp_config: {fsdp_version: 1, fsdp_reshard_after_forward: SHARD_GRAD_OP}\n",
       {ParallelMode::kZero, 2}},
      {"fsdp_config: {fsdp_version: 2, fsdp_reshard_after_forward: true}\n",
       {ParallelMode::kZero, 3}},
      {"fsdp_config: {fsdp_version: 2, fsdp_reshard_after_forward: false}\n",
       {ParallelMode::kZero, 2}},
      {"", {ParallelMode::kZero, 3}},  // accelerate's default: FULL_SHARD
  };
  for (const auto& [fsdp, want] : cases) {
    CAPTURE(fsdp);
    StatusOr<LaunchConfig> cfg = Resolve("distributed_type: FSDP\n" + fsdp);
    REQUIRE(cfg.ok());
    CHECK(cfg->train.parallel.mode == want.mode);
    if (want.mode == ParallelMode::kZero) CHECK(cfg->train.parallel.zero_stage == want.zero_stage);
    CHECK(cfg->origins["train.parallel.mode"].kind == Origin::Kind::kDerived);
    CHECK(cfg->warnings.empty());  // one machine: HYBRID_SHARD is FULL_SHARD exactly
  }
  StatusOr<LaunchConfig> cfg = Resolve(
      "distributed_type: FSDP\nfsdp_config:\n"
      "  fsdp_sharding_strategy: SHARD_GRAD_OP\n");
  REQUIRE(cfg.ok());
  CHECK(cfg->origins["train.parallel.zero_stage"].ToString() ==
        "derived (distributed_type: FSDP at acc.yaml:1, fsdp_sharding_strategy: SHARD_GRAD_OP at "
        "acc.yaml:3)");
  // The script's Accelerator still gets the settings as written.
  CHECK(cfg->accelerate["fsdp_sharding_strategy"] == "SHARD_GRAD_OP");

  // accelerate launch's flag does the same as distributed_type.
  LaunchConfig flags;
  REQUIRE(Load("train:\n  max_steps: 1\n", &flags).ok());
  REQUIRE(ApplySetting("use_fsdp", "true", Origin{Origin::Kind::kFlag, "--use_fsdp"}, &flags).ok());
  REQUIRE(ApplySetting("fsdp_sharding_strategy", "SHARD_GRAD_OP",
                       Origin{Origin::Kind::kFlag, "--fsdp_sharding_strategy"}, &flags)
              .ok());
  REQUIRE(Validate(&flags).ok());
  CHECK(flags.train.parallel.mode == ParallelMode::kZero);
  CHECK(flags.train.parallel.zero_stage == 2);

  Status bad =
      Resolve("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: ZERO3\n").status();
  CHECK(bad.message() ==
        "acc.yaml:3: fsdp_sharding_strategy: 'ZERO3' is not one of FULL_SHARD (1), SHARD_GRAD_OP "
        "(2), NO_SHARD (3), HYBRID_SHARD (4), HYBRID_SHARD_ZERO2 (5)");
  CHECK(Resolve("distributed_type: FSDP\nfsdp_config: {fsdp_sharding_strategy: 6}\n")
            .status()
            .code() == Status::Code::kInvalidConfig);
}

TEST_CASE("HybridShardAcrossMachinesWarnsThatShardingSpansTheWholeWorld") {
  StatusOr<LaunchConfig> cfg = Resolve(
      "distributed_type: FSDP\nnum_machines: 2\nmachine_rank: 0\n"
      "fsdp_config: {fsdp_sharding_strategy: HYBRID_SHARD_ZERO2}\n");
  REQUIRE(cfg.ok());
  CHECK(cfg->train.parallel.zero_stage == 2);
  REQUIRE(cfg->warnings.size() == 1);
  CHECK(cfg->warnings[0].find("fsdp_sharding_strategy: HYBRID_SHARD_ZERO2 at acc.yaml:4: the "
                              "built-in trainer shards over every rank of every machine "
                              "(parallel.mode zero, zero_stage 2)") != std::string::npos);
  CHECK(cfg->warnings[0].find("replicating across machines is not built yet") != std::string::npos);
}

TEST_CASE("FsdpSettingsTheTrainerCannotHonourAreNamedInOneWarning") {
  StatusOr<LaunchConfig> cfg = Resolve(
      "distributed_type: FSDP\n"
      "fsdp_config:\n"
      "  fsdp_sharding_strategy: FULL_SHARD\n"
      "  fsdp_offload_params: true\n"
      "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
      "  fsdp_transformer_layer_cls_to_wrap: Block\n"
      "  fsdp_backward_prefetch: BACKWARD_PRE\n"
      "  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
      "  fsdp_sync_module_states: true\n"
      "  fsdp_activation_checkpointing: false\n");
  REQUIRE(cfg.ok());
  REQUIRE(cfg->warnings.size() == 1);
  CHECK(cfg->warnings[0] ==
        "the built-in trainer runs distributed_type: FSDP at acc.yaml:1, fsdp_sharding_strategy: "
        "FULL_SHARD at acc.yaml:3 as parallel.mode zero, zero_stage 3; these settings have no "
        "effect on it: fsdp_offload_params true at acc.yaml:4: no CPU offload; "
        "fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP at acc.yaml:5: the trainer picks its own "
        "units; fsdp_transformer_layer_cls_to_wrap Block at acc.yaml:6: the trainer picks its "
        "own units");
}

TEST_CASE("DeepSpeedZeroStageMapsOntoZeroStagesAndStageZeroIsDdp") {
  for (int stage = 0; stage <= 3; ++stage) {
    CAPTURE(stage);
    StatusOr<LaunchConfig> cfg = Resolve(
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
        "  zero_stage: " +
        std::to_string(stage) + "\n");
    REQUIRE(cfg.ok());
    CHECK(cfg->train.parallel.mode == (stage == 0 ? ParallelMode::kDdp : ParallelMode::kZero));
    if (stage > 0) CHECK(cfg->train.parallel.zero_stage == stage);
    CHECK(cfg->warnings.empty());
  }
  StatusOr<LaunchConfig> none = Resolve("distributed_type: DEEPSPEED\n");
  REQUIRE(none.ok());
  CHECK(none->train.parallel.zero_stage == 2);  // accelerate's default stage
  CHECK(Resolve("distributed_type: DEEPSPEED\ndeepspeed_config: {zero_stage: 4}\n")
            .status()
            .message() == "acc.yaml:2: zero_stage: '4' is not one of 0, 1, 2, 3");

  // What `accelerate config` writes for stage 3 with offload: the stage is honoured, offload
  // and the rest named.
  StatusOr<LaunchConfig> cfg = Resolve(
      "distributed_type: DEEPSPEED\n"
      "deepspeed_config:\n"
      "  zero_stage: 3\n"
      "  offload_optimizer_device: cpu\n"
      "  offload_param_device: none\n"
      "  gradient_accumulation_steps: 1\n"
      "  gradient_clipping: 1.0\n"
      "  zero3_init_flag: true\n"
      "  zero3_save_16bit_model: false\n");
  REQUIRE(cfg.ok());
  CHECK(cfg->train.parallel.zero_stage == 3);
  REQUIRE(cfg->warnings.size() == 1);
  CHECK(cfg->warnings[0] ==
        "the built-in trainer runs distributed_type: DEEPSPEED at acc.yaml:1, zero_stage: 3 at "
        "acc.yaml:3 as parallel.mode zero, zero_stage 3; these settings have no effect on it: "
        "offload_optimizer_device cpu at acc.yaml:4: no offload; zero3_init_flag true at "
        "acc.yaml:8: every rank builds the model, then shards it; gradient_clipping 1.0 at "
        "acc.yaml:7: use train.max_grad_norm");
}

TEST_CASE("DeepSpeedConfigFileGivesTheStage") {
  const std::string path = "/tmp/launch_loader_test_ds_" + std::to_string(::getpid()) + ".json";
  {
    std::ofstream f(path);
    f << R"({"train_batch_size": "auto", "zero_optimization": {"stage": 1,
          "offload_optimizer": {"device": "cpu"}}})";
  }
  StatusOr<LaunchConfig> cfg = Resolve(
      "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: " + path + "\n");
  std::remove(path.c_str());
  REQUIRE(cfg.ok());
  CHECK(cfg->train.parallel.mode == ParallelMode::kZero);
  CHECK(cfg->train.parallel.zero_stage == 1);
  REQUIRE(cfg->warnings.size() == 1);
  CHECK(cfg->warnings[0].find(path + ": zero_optimization.offload_optimizer.device cpu") !=
        std::string::npos);
  Status missing =
      Resolve("distributed_type: DEEPSPEED\ndeepspeed_config: {deepspeed_config_file: " + path +
              "}\n")
          .status();
  CHECK(missing.message().find("acc.yaml:2: deepspeed_config_file: cannot read '" + path + "'") ==
        0);
}

TEST_CASE("TrainKeysAndAccelerateShardingFollowPrecedence") {
  // The same file says two things: an error naming both.
  LaunchConfig both;
  Status same = LoadValid("distributed_type: FSDP\ntrain:\n  parallel: {mode: ddp}\n", &both);
  CHECK(same.message() ==
        "train.yaml:3: train.parallel.mode ddp disagrees with distributed_type: FSDP at "
        "train.yaml:1, which the built-in trainer runs as parallel.mode zero, zero_stage 3; give "
        "one of the two");
  LaunchConfig stages;
  Status stage = LoadValid(
      "distributed_type: DEEPSPEED\ndeepspeed_config: {zero_stage: 2}\n"
      "train:\n  parallel: {mode: zero, zero_stage: 3}\n",
      &stages);
  CHECK(stage.message().find("train.yaml:4: train.parallel.zero_stage 3 disagrees with") == 0);

  // Agreeing or silent keys combine: mode zero in train:, the stage from accelerate's default;
  // a stage given in train: stands when accelerate only has its default.
  LaunchConfig agree;
  REQUIRE(LoadValid("distributed_type: FSDP\ntrain:\n  parallel: {mode: zero}\n", &agree).ok());
  CHECK(agree.train.parallel.zero_stage == 3);
  LaunchConfig own_stage;
  REQUIRE(LoadValid("distributed_type: FSDP\ntrain:\n  parallel: {mode: zero, zero_stage: 1}\n",
                    &own_stage)
              .ok());
  CHECK(own_stage.train.parallel.zero_stage == 1);

  // A flag outranks the file, whichever side it is on.
  LaunchConfig flag_mode;
  REQUIRE(Load("distributed_type: FSDP\ntrain:\n  max_steps: 1\n", &flag_mode).ok());
  REQUIRE(ApplyTrainSetting("parallel.mode", TrainValue::Scalar("ddp"),
                            Origin{Origin::Kind::kFlag, "--parallel.mode"}, "--parallel.mode",
                            &flag_mode)
              .ok());
  REQUIRE(Validate(&flag_mode).ok());
  CHECK(flag_mode.train.parallel.mode == ParallelMode::kDdp);
  LaunchConfig flag_fsdp;
  REQUIRE(Load("train:\n  parallel: {mode: ddp}\n", &flag_fsdp).ok());
  REQUIRE(
      ApplySetting("use_fsdp", "true", Origin{Origin::Kind::kFlag, "--use_fsdp"}, &flag_fsdp).ok());
  REQUIRE(Validate(&flag_fsdp).ok());
  CHECK(flag_fsdp.train.parallel.mode == ParallelMode::kZero);
  CHECK(flag_fsdp.origins["train.parallel.mode"].ToString() ==
        "derived (use_fsdp: true at flag --use_fsdp)");

  // Without train: the settings are only for the script's Accelerator.
  LaunchConfig script;
  REQUIRE(Load("distributed_type: FSDP\nfsdp_config: {fsdp_sharding_strategy: 9}\n", &script).ok());
  REQUIRE(Validate(&script).ok());
  CHECK(script.accelerate["fsdp_sharding_strategy"] == "9");
}

TEST_CASE("DilocoKeysLoadAndApplyOnlyToLocalSgdWithNesterov") {
  LaunchConfig cfg;
  CHECK(LoadValid("train:\n  local_sgd_steps: 20\n  local_sgd: {outer: nesterov, outer_lr: 0.5, "
                  "outer_momentum: 0.8}\n",
                  &cfg)
            .ok());
  CHECK(cfg.train.local_sgd.outer == OuterOptimizer::kNesterov);
  CHECK(cfg.train.local_sgd.outer_lr == 0.5);
  CHECK(cfg.train.local_sgd.outer_momentum == 0.8);
  LaunchConfig off;
  std::string message = LoadValid("train:\n  local_sgd: {outer: nesterov}\n", &off).message();
  CHECK(message.find("train.yaml:2") == 0);
  CHECK(message.find("train.local_sgd.outer") != std::string::npos);
  CHECK(message.find("local_sgd_steps > 0") != std::string::npos);
  LaunchConfig plain;
  message =
      LoadValid("train:\n  local_sgd_steps: 4\n  local_sgd: {outer_lr: 0.5}\n", &plain).message();
  CHECK(message.find("local_sgd.outer nesterov") != std::string::npos);
  LaunchConfig bad;
  message = LoadValid("train:\n  local_sgd_steps: 4\n  local_sgd: {outer: adam}\n", &bad).message();
  CHECK(message.find("average") != std::string::npos);
  CHECK(message.find("nesterov") != std::string::npos);
}

TEST_CASE("LocalSgdRefusesModeNoneAndSyncEachBatchNamingTheKeysAndTheirLines") {
  LaunchConfig none;
  CHECK(LoadValid("train:\n  local_sgd_steps: 4\n  parallel: {mode: none}\n", &none).message() ==
        "train.yaml:2: train.local_sgd_steps: Local SGD averages parameters across processes "
        "every K steps; parallel.mode none trains each process alone (use mode ddp, the default, "
        "with local_sgd_steps)");
  LaunchConfig sync;
  CHECK(
      LoadValid("train:\n  parallel: {mode: ddp}\n  sync_each_batch: true\n  local_sgd_steps: 4\n",
                &sync)
          .message() ==
      "train.yaml:3: train.sync_each_batch: all-reduces gradients every micro-batch, but Local "
      "SGD (local_sgd_steps 4) all-reduces no gradients; it averages parameters every K steps");
  // The same rules for a configuration built in code (Accelerator::Create).
  TrainConfig t;
  t.parallel.mode = ParallelMode::kNone;
  t.local_sgd_steps = 2;
  CHECK(CheckTrainRulesStatus(t, 2).message().find("train.local_sgd_steps: Local SGD") == 0);
  t.parallel.mode = ParallelMode::kDdp;
  CHECK(CheckTrainRulesStatus(t, 2).ok());
  t.sync_each_batch = true;
  CHECK(CheckTrainRulesStatus(t, 2).message().find("train.sync_each_batch: ") == 0);
}

TEST_CASE("AStrategysKeysAreRefusedUnderAnotherMode") {
  // Each would be ignored: the run would quietly be another than the one asked for.
  LaunchConfig cfg;
  CHECK(LoadValid("train:\n  parallel: {zero_stage: 3}\n", &cfg).message() ==
        "train.yaml:2: train.parallel.zero_stage applies to mode zero, but train.parallel.mode "
        "is ddp: it would be ignored; set the mode it belongs to, or drop it");
  LaunchConfig dp;
  CHECK(LoadValid("train:\n  parallel:\n    mode: ddp\n    replicas: 4\n", &dp).message() ==
        "train.yaml:4: train.parallel.replicas applies to mode dp, but train.parallel.mode is "
        "ddp: it would be ignored; set the mode it belongs to, or drop it");
  LaunchConfig pipe;
  CHECK(LoadValid("train:\n  parallel: {mode: zero, microbatches: 8}\n", &pipe)
            .message()
            .find("train.parallel.microbatches applies to a pipeline (stages > 1, or mode "
                  "pipeline), but train.parallel.mode is zero") != std::string::npos);
  // In their own modes they are taken.
  for (const char* ok : {"{mode: zero, zero_stage: 3}", "{mode: dp, replicas: 4}",
                         "{mode: zero, stages: 2, microbatches: 8}",
                         "{mode: pipeline, stages: 2, microbatches: 8, schedule: gpipe}",
                         "{find_unused_parameters: true}"}) {
    LaunchConfig good;
    CHECK_MESSAGE(LoadValid(std::string("train:\n  parallel: ") + ok + "\n", &good).ok(), ok);
  }
}

TEST_CASE("PowerSgdTakesPowerSGDStatesOptionsAndItsRule") {
  LaunchConfig cfg;
  REQUIRE(LoadValid("train:\n  parallel:\n    comm_hook: power_sgd\n    power_sgd:\n"
                    "      matrix_approximation_rank: 4\n      start_powerSGD_iter: 10\n"
                    "      warm_start: false\n      random_seed: 3\n",
                    &cfg)
              .ok());
  const config::PowerSgdConfig& p = cfg.train.parallel.power_sgd;
  CHECK(cfg.train.parallel.comm_hook == config::CommHook::kPowerSgd);
  CHECK(p.matrix_approximation_rank == 4);
  CHECK(p.start_powerSGD_iter == 10);
  CHECK_FALSE(p.warm_start);
  CHECK(p.use_error_feedback);  // PyTorch's default
  CHECK(p.min_compression_rate == 2.0);
  CHECK(p.random_seed == 3);
  // PowerSGDState's ValueError, as a config error naming the key.
  LaunchConfig early;
  CHECK(LoadValid("train:\n  parallel:\n    comm_hook: power_sgd\n    power_sgd: "
                  "{start_powerSGD_iter: 1}\n",
                  &early)
            .message() ==
        "train.yaml:4: train.parallel.power_sgd.start_powerSGD_iter: must be > 1 with "
        "use_error_feedback or warm_start (PowerSGD starts after DDP's first two steps)");
  LaunchConfig plain;
  CHECK(LoadValid("train:\n  parallel:\n    comm_hook: power_sgd\n    power_sgd: "
                  "{start_powerSGD_iter: 1, use_error_feedback: false, warm_start: false}\n",
                  &plain)
            .ok());
  LaunchConfig staged;
  CHECK(LoadValid("train:\n  parallel: {comm_hook: power_sgd, stages: 2}\n", &staged).message() ==
        "train.yaml:2: train.parallel.comm_hook: power_sgd applies to ddp over whole replicas (no "
        "stages, no tensor or context groups)");
  LaunchConfig rank;
  CHECK(LoadValid("train:\n  parallel: {comm_hook: power_sgd, power_sgd: "
                  "{matrix_approximation_rank: 0}}\n",
                  &rank)
            .message()
            .find("train.parallel.power_sgd.matrix_approximation_rank") != std::string::npos);
}

TEST_CASE("ZeroRefusesLocalSgdCommHookAndAnotherModeFromAccelerate") {
  LaunchConfig cfg;
  CHECK(LoadValid("train:\n  parallel: {mode: zero}\n  local_sgd_steps: 4\n", &cfg).message() ==
        "train.yaml:3: train.local_sgd_steps: Local SGD keeps a whole replica on every rank and "
        "averages parameters; it does not combine with parallel.mode zero (state sharded over "
        "the ranks)");
  LaunchConfig hook;
  CHECK(LoadValid("train:\n  parallel: {mode: zero, comm_hook: bf16}\n", &hook).message() ==
        "train.yaml:2: train.parallel.comm_hook: applies to mode ddp (its gradient buckets), not "
        "zero");
  // The mode is one value, so zero meets dp or pipeline only where accelerate's settings ask
  // for zero and train: for another mode: refused, naming both.
  for (const char* other : {"pipeline", "dp"}) {
    LaunchConfig mixed;
    CHECK(LoadValid(std::string("distributed_type: DEEPSPEED\ndeepspeed_config: {zero_stage: 1}\n"
                                "train:\n  parallel: {mode: ") +
                        other + "}\n",
                    &mixed)
              .message() == std::string("train.yaml:4: train.parallel.mode ") + other +
                                " disagrees with distributed_type: DEEPSPEED at train.yaml:1, "
                                "zero_stage: 1 at train.yaml:2, which the built-in trainer runs "
                                "as parallel.mode zero, zero_stage 1; give one of the two");
  }
  // A flag that changes a pipeline file's mode leaves the file's pipeline keys behind, inert
  // (as for every mode): the effective configuration the workers read carries them too.
  LaunchConfig changed;
  REQUIRE(
      Load("train:\n  parallel: {mode: pipeline, stages: 2, microbatches: 4}\n", &changed).ok());
  REQUIRE(ApplyTrainSetting("parallel.mode", TrainValue::Scalar("zero"),
                            Origin{Origin::Kind::kFlag, "--parallel.mode"}, "--parallel.mode",
                            &changed)
              .ok());
  REQUIRE(ValidateTrain(&changed).ok());
  LaunchConfig worker;
  REQUIRE(LoadYamlString(EffectiveConfigYaml(changed), "effective.yaml", &worker).ok());
  worker.effective = true;  // as train --effective_config loads it
  CHECK(ValidateTrain(&worker).ok());
  // A file that sets the mode and another mode's keys is refused instead: the same keys are
  // not inert there, but a mistake.
  LaunchConfig same_layer;
  CHECK_FALSE(
      LoadValid("train:\n  parallel: {mode: zero, stages: 1, microbatches: 4}\n", &same_layer)
          .ok());
  CHECK(worker.train.parallel.mode == ParallelMode::kZero);
  // The same rule for a configuration built in code.
  TrainConfig t;
  t.parallel.mode = ParallelMode::kZero;
  t.local_sgd_steps = 2;
  CHECK(CheckTrainRulesStatus(t, 2).message().find("train.local_sgd_steps: Local SGD") == 0);
}

TEST_CASE("SyncBatchNormAppliesToDdpAndDpOnly") {
  LaunchConfig ddp;
  REQUIRE(LoadValid("train:\n  parallel: {mode: ddp, sync_batchnorm: true}\n", &ddp).ok());
  CHECK(ddp.train.parallel.sync_batchnorm);
  LaunchConfig dp;
  REQUIRE(LoadValid("train:\n  parallel: {mode: dp, sync_batchnorm: true}\n", &dp).ok());
  LaunchConfig zero;
  CHECK(LoadValid("train:\n  parallel: {mode: zero, sync_batchnorm: true}\n", &zero).message() ==
        "train.yaml:2: train.parallel.sync_batchnorm: applies to modes ddp and dp (statistics "
        "over the data-parallel batch), not zero");
  LaunchConfig lsgd;
  const std::string message =
      LoadValid("train:\n  parallel: {sync_batchnorm: true}\n  local_sgd_steps: 4\n", &lsgd)
          .message();
  CHECK(message.find("train.parallel.sync_batchnorm") != std::string::npos);
  CHECK(message.find("local_sgd_steps") != std::string::npos);
  LaunchConfig ckpt;
  CHECK(LoadValid("train:\n  model: {type: cnn, activation_checkpointing: true}\n"
                  "  data: {type: synthetic}\n  parallel: {sync_batchnorm: true}\n",
                  &ckpt)
            .message()
            .find("model.activation_checkpointing") != std::string::npos);
}

TEST_CASE("OptimizerImplementationIsAutoByDefaultAndRefusesBadValuesAndSgdKernels") {
  CHECK(TrainConfig().optimizer.implementation == OptimizerImplementation::kAuto);
  for (const auto& [name, value] : std::vector<std::pair<std::string, OptimizerImplementation>>{
           {"auto", OptimizerImplementation::kAuto},
           {"for_loop", OptimizerImplementation::kForLoop},
           {"foreach", OptimizerImplementation::kForeach},
           {"fused", OptimizerImplementation::kFused}}) {
    LaunchConfig cfg;
    REQUIRE(
        LoadValid("train:\n  optimizer:\n    type: adam\n    implementation: " + name + "\n", &cfg)
            .ok());
    CHECK(cfg.train.optimizer.implementation == value);
    CHECK(std::string(ToString(value)) == name);
  }
  LaunchConfig bad;
  CHECK(Load("train:\n  optimizer:\n    implementation: fussed\n", &bad).message() ==
        "train.yaml:3: train.optimizer.implementation: 'fussed' is not one of auto, for_loop, "
        "foreach, fused (did you mean 'fused'?)");
  LaunchConfig list;
  CHECK(Load("train:\n  optimizer: {implementation: [foreach]}\n", &list).message() ==
        "train.yaml:2: train.optimizer.implementation: expected a single value");
  // SGD has no multi-tensor or fused kernel here: refused at the key, whichever comes first.
  LaunchConfig sgd;
  CHECK(LoadValid("train:\n  optimizer:\n    type: sgd\n    implementation: foreach\n", &sgd)
            .message() ==
        "train.yaml:4: train.optimizer.implementation: foreach is an Adam and AdamW "
        "implementation; sgd takes auto or for_loop");
  LaunchConfig sgd_loop;
  CHECK(LoadValid("train:\n  optimizer: {type: sgd, implementation: for_loop}\n", &sgd_loop).ok());
  // Not part of the run identity: a checkpoint resumes under any implementation.
  LaunchConfig fused;
  REQUIRE(LoadValid("train:\n  optimizer: {implementation: fused}\n", &fused).ok());
  for (const auto& [key, value] : TrajectorySettings(fused.train))
    CHECK(key != "train.optimizer.implementation");
  // A flag sets it too (one key table).
  REQUIRE(ApplyTrainSetting("optimizer.implementation", TrainValue::Scalar("foreach"),
                            Origin{Origin::Kind::kFlag, "--optimizer.implementation"},
                            "--optimizer.implementation", &fused)
              .ok());
  CHECK(fused.train.optimizer.implementation == OptimizerImplementation::kForeach);
  TrainConfig t;
  t.optimizer.type = OptimizerType::kSgd;
  t.optimizer.implementation = OptimizerImplementation::kFused;
  CHECK(CheckTrainRulesStatus(t, 1).message().find("train.optimizer.implementation: fused") == 0);
}

TEST_CASE("PrintConfigShowsTheZeroKeysAndWhereTheyCameFrom") {
  StatusOr<LaunchConfig> cfg =
      Resolve("distributed_type: DEEPSPEED\ndeepspeed_config: {zero_stage: 2}\n");
  REQUIRE(cfg.ok());
  const std::string printed = FormatConfig(*cfg);
  CHECK(printed.find("\ntrain.parallel.mode: zero ") != std::string::npos);
  CHECK(printed.find("\ntrain.parallel.zero_stage: 2 ") != std::string::npos);
  CHECK(printed.find("# derived (distributed_type: DEEPSPEED at acc.yaml:1, zero_stage: 2 at "
                     "acc.yaml:2)") != std::string::npos);
  // The workers read the effective configuration, which carries the mapped keys.
  LaunchConfig back;
  REQUIRE(LoadYamlString(EffectiveConfigYaml(*cfg), "effective.yaml", &back).ok());
  back.effective = true;  // as train --effective_config loads it
  REQUIRE(ValidateTrain(&back).ok());
  CHECK(back.train.parallel.mode == ParallelMode::kZero);
  CHECK(back.train.parallel.zero_stage == 2);
}

TEST_CASE("TheActiveEnvironmentsPythonUnlessOneWasChosen") {
  char templ[] = "/tmp/launch-venv-test-XXXXXX";
  REQUIRE(mkdtemp(templ) != nullptr);
  const std::string venv = templ, conda = venv + "/conda";
  REQUIRE(MakeDirs(venv + "/bin").ok());
  REQUIRE(MakeDirs(conda + "/bin").ok());
  REQUIRE(symlink("/bin/sh", (venv + "/bin/python").c_str()) == 0);
  REQUIRE(symlink("/bin/sh", (conda + "/bin/python3").c_str()) == 0);

  LaunchConfig plain;
  REQUIRE(ApplyEnvironment({}, &plain).ok());
  CHECK(plain.python == "python3");
  CHECK(plain.origins.count("python") == 0);

  LaunchConfig active;
  REQUIRE(ApplyEnvironment({{"VIRTUAL_ENV", venv}, {"CONDA_PREFIX", conda}}, &active).ok());
  CHECK(active.python == venv + "/bin/python");
  CHECK(active.origins["python"].ToString() == "environment VIRTUAL_ENV");
  LaunchConfig in_conda;
  REQUIRE(ApplyEnvironment({{"CONDA_PREFIX", conda}}, &in_conda).ok());
  CHECK(in_conda.python == conda + "/bin/python3");

  // A choice of any layer wins: the YAML, PYTHON_EXEC, LAUNCH_PYTHON (and the flags, applied
  // after the environment).
  LaunchConfig yaml;
  REQUIRE(Load("python: /opt/py/bin/python3\n", &yaml).ok());
  REQUIRE(ApplyEnvironment({{"VIRTUAL_ENV", venv}}, &yaml).ok());
  CHECK(yaml.python == "/opt/py/bin/python3");
  LaunchConfig exec;
  REQUIRE(ApplyEnvironment({{"VIRTUAL_ENV", venv}, {"PYTHON_EXEC", "/opt/x"}}, &exec).ok());
  CHECK(exec.python == "/opt/x");

  // An environment without an interpreter is named, and PATH's python3 stays.
  LaunchConfig broken;
  REQUIRE(ApplyEnvironment({{"VIRTUAL_ENV", venv + "/nothing"}}, &broken).ok());
  CHECK(broken.python == "python3");
  REQUIRE(broken.warnings.size() == 1);
  CHECK(broken.warnings[0] == "VIRTUAL_ENV=" + venv +
                                  "/nothing has no bin/python; Python programs run under "
                                  "python3 from PATH");
}

}  // namespace
TEST_CASE("RecoverIsRestartOrInPlace") {
  LaunchConfig cfg;
  CHECK_FALSE(cfg.recover_in_place);
  REQUIRE(ApplySetting("recover", "in_place", Origin{Origin::Kind::kFlag, "--recover"}, &cfg).ok());
  CHECK(cfg.recover_in_place);
  REQUIRE(ApplySetting("recover", "restart", Origin{Origin::Kind::kFlag, "--recover"}, &cfg).ok());
  CHECK_FALSE(cfg.recover_in_place);
  CHECK(ApplySetting("recover", "inplace", Origin{Origin::Kind::kFlag, "--recover"}, &cfg)
            .message() == "--recover: expected restart or in_place, got 'inplace'");
}

}  // namespace launch::config
