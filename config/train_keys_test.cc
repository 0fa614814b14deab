#include "config/train_keys.h"

#include <doctest/doctest.h>

#include <set>

#include "base/strings.h"

#include "config/loader.h"
#include "config/train_cli.h"

namespace launch::config {
namespace {

// A configuration in which `key` applies: the model, data, optimizer, scheduler and mode it
// belongs to (Local SGD's keys: DiLoCo's).
TrainConfig ConfigWhere(const TrainKey& key) {
  for (ModelType m :
       {ModelType::kMlp, ModelType::kCnn, ModelType::kTransformer, ModelType::kTorchScript})
    for (DataType d : {DataType::kSynthetic, DataType::kIdx, DataType::kText, DataType::kCsv})
      for (bool diloco : {false, true}) {
        TrainConfig t;
        t.present = true;
        t.model.type = m;
        t.data.type = d;
        if (diloco) {
          t.local_sgd_steps = 4;
          t.local_sgd.outer = OuterOptimizer::kNesterov;
        }
        if (key.AppliesTo(t)) return t;
      }
  FAIL("no configuration has " << key.path);
  return {};
}

// A value other than the current one that the key accepts: an enum's other name, the other
// boolean, a list, or the first of a few scalars (a double with 17 significant digits first,
// text with YAML's special characters) that its parser and bounds take.
TrainValue OtherValue(const TrainKey& key, const LaunchConfig& cfg) {
  const TrainValue now = key.show(cfg.train);
  std::vector<TrainValue> candidates;
  for (const std::string& c : key.choices) candidates.push_back(TrainValue::Scalar(c));
  if (key.is_list) {
    for (auto items : std::vector<std::vector<std::string>>{
             {"3", "32", "32"}, {"input", "target"}, {"0.5", "2"}, {"bias"}})
      candidates.push_back(TrainValue::List(items));
  }
  for (const char* s : {"true", "false", "0.30000000000000004", "8", "4", "0.25", "3", "never",
                        "some/where: odd # text"})
    candidates.push_back(TrainValue::Scalar(s));
  for (const TrainValue& v : candidates) {
    if (v.Text() == now.Text()) continue;
    LaunchConfig trial = cfg;
    if (ApplyTrainSetting(key.path, v, Origin{}, "", &trial).ok()) return v;
  }
  FAIL("no other value for " << key.path);
  return now;
}

TEST_CASE("EveryTrainKeyParsesPrintsAndRoundTripsThroughTheEffectiveConfiguration") {
  std::set<std::string> paths;
  for (const TrainKey& key : TrainKeys()) {
    CAPTURE(key.path);
    paths.insert(key.path);
    CHECK_FALSE(key.doc.empty());
    LaunchConfig cfg;
    cfg.train = ConfigWhere(key);
    const TrainValue v = OtherValue(key, cfg);
    REQUIRE(ApplyTrainSetting(key.path, v, Origin{Origin::Kind::kFlag, "--" + key.path},
                              "--" + key.path, &cfg)
                .ok());
    // Printed as given (numbers in their shortest exact form).
    CHECK(key.show(cfg.train).Text() == v.Text());
    // The effective configuration reads back to the same settings, the origin in a comment.
    std::string yaml = EffectiveConfigYaml(cfg);
    CHECK(yaml.find("# flag --" + key.path) != std::string::npos);
    LaunchConfig back;
    REQUIRE(LoadYamlString(yaml, "effective.yaml", &back).ok());
    CHECK(TrainSettings(back.train) == TrainSettings(cfg.train));
  }
  // The keys --print_config never showed before the table.
  for (const char* p :
       {"parallel.bucket_cap_mb", "parallel.find_unused_parameters", "log_every", "eval_every",
        "save_model", "resume_allow_changes", "timeline.from_step", "timeline.steps"})
    CHECK(paths.count(p) == 1);
}

TEST_CASE("PrintConfigListsEveryKeyThatApplies") {
  LaunchConfig cfg;
  REQUIRE(
      LoadYamlString("train:\n  model: {type: cnn}\n  data: {type: idx}\n", "t.yaml", &cfg).ok());
  REQUIRE(Validate(&cfg).ok());
  std::string printed = FormatConfig(cfg);
  for (const TrainKey& key : TrainKeys()) {
    CAPTURE(key.path);
    const bool shown = printed.find("\ntrain." + key.path + ": ") != std::string::npos;
    CHECK(shown == key.AppliesTo(cfg.train));
  }
  CHECK(printed.find("train.model.type: cnn") != std::string::npos);
  CHECK(printed.find("# t.yaml:2") != std::string::npos);
}

TEST_CASE("BadTrainValuesNameTheirPlaceAndKey") {
  auto yaml_error = [](const std::string& text) {
    LaunchConfig cfg;
    Status s = LoadYamlString(text, "t.yaml", &cfg);
    return s.ok() ? Validate(&cfg).message() : s.message();
  };
  CHECK(yaml_error("train:\n  optimizer:\n    lr: -1\n") ==
        "t.yaml:3: train.optimizer.lr: value -1 is out of range [1e-12, 1000]");
  CHECK(yaml_error("train:\n  timeline: {steps: 5000}\n") ==
        "t.yaml:2: train.timeline.steps: value 5000 is out of range [0, 1000]");
  CHECK(yaml_error("train:\n  parallel: {bucket_cap_mb: [1]}\n") ==
        "t.yaml:2: train.parallel.bucket_cap_mb: expected a single value");
  CHECK(yaml_error("train:\n  model: {type: transformer, d_model: 10, heads: 4}\n"
                   "  data: {type: text, path: /etc/hostname}\n") ==
        "t.yaml:2: train.model.heads: d_model 10 is not divisible by heads 4");
  CHECK(yaml_error("train:\n  model: 5\n") ==
        "t.yaml:2: train.model: expected a mapping (key: value)");

  LaunchConfig cfg;
  REQUIRE(LoadYamlString("train:\n  seed: 1\n", "t.yaml", &cfg).ok());
  CHECK(ApplyTrainSetting("parallel.mdoe", TrainValue::Scalar("ddp"),
                          Origin{Origin::Kind::kFlag, "--parallel.mdoe"}, "--parallel.mdoe", &cfg)
            .message() ==
        "--parallel.mdoe: train.parallel.mdoe: unknown key (did you mean "
        "'parallel.mode'?)");
  CHECK(ApplyTrainSetting("model.heads", TrainValue::Scalar("2"),
                          Origin{Origin::Kind::kFlag, "--model.heads"}, "--model.heads", &cfg)
            .message() ==
        "--model.heads: train.model.heads: applies only with model.type "
        "transformer");
  Status env = ApplyEnvironment({{"LAUNCH_TRAIN_MAX_STEP", "3"}}, &cfg);
  CHECK(env.message() ==
        "environment LAUNCH_TRAIN_MAX_STEP: no train: key has this name (did you mean "
        "'LAUNCH_TRAIN_MAX_STEPS'?)");
}

TEST_CASE("TrainLayersApplyFlagOverEnvironmentOverYaml") {
  LaunchConfig cfg;
  REQUIRE(
      LoadYamlString("train:\n  max_steps: 10\n  optimizer: {type: sgd, lr: 0.1}\n", "t.yaml", &cfg)
          .ok());
  REQUIRE(ApplyEnvironment({{"LAUNCH_TRAIN_MAX_STEPS", "20"},
                            {"LAUNCH_TRAIN_OPTIMIZER_LR", "0.2"},
                            {"ACCELERATE_MIXED_PRECISION", "bf16"}},
                           &cfg)
              .ok());
  CHECK(cfg.train.max_steps == 20);
  CHECK(cfg.train.mixed_precision == "bf16");
  CHECK(cfg.origins["mixed_precision"].ToString() == "environment ACCELERATE_MIXED_PRECISION");
  // LAUNCH_MIXED_PRECISION outranks what accelerate exported.
  REQUIRE(ApplyEnvironment(
              {{"ACCELERATE_MIXED_PRECISION", "bf16"}, {"LAUNCH_MIXED_PRECISION", "no"}}, &cfg)
              .ok());
  CHECK(cfg.train.mixed_precision == "no");
  StatusOr<TrainCommandLine> cl =
      ParseTrainCommandLine({"--max_steps", "30", "--model.layers", "[4, 8, 2]"});
  REQUIRE(cl.ok());
  REQUIRE(ApplyTrainFlags(*cl, "", &cfg).ok());
  REQUIRE(Validate(&cfg).ok());
  CHECK(cfg.train.max_steps == 30);
  CHECK(cfg.train.model.mlp_layers == std::vector<int64_t>{4, 8, 2});
  CHECK(cfg.train.optimizer.lr == 0.2);
  CHECK(cfg.train.optimizer.weight_decay == 0.0);  // sgd's default, not adamw's
  CHECK(cfg.origins["train.max_steps"].ToString() == "flag --max_steps");
  CHECK(cfg.origins["train.optimizer.lr"].ToString() == "environment LAUNCH_TRAIN_OPTIMIZER_LR");
}

TEST_CASE("TrainCommandLineSeparatesConfigFlagsFromProgramOptions") {
  StatusOr<TrainCommandLine> cl =
      ParseTrainCommandLine({"cfg.yaml", "--dump-params", "--optimizer.weight-decay=0.5"});
  REQUIRE(cl.ok());
  CHECK(cl->config_path == "cfg.yaml");
  CHECK(cl->dump_params);
  REQUIRE(cl->settings.size() == 1);
  CHECK(cl->settings[0].path == "optimizer.weight_decay");
  CHECK(cl->settings[0].value == "0.5");
  CHECK(cl->ProgramOptions() == std::vector<std::string>{"--dump_params"});
  StatusOr<TrainCommandLine> bad = ParseTrainCommandLine({"cfg.yaml", "--optimiser.lr", "1"});
  CHECK(bad.status().message() ==
        "unknown flag '--optimiser.lr' (did you mean 'optimizer.lr'?); see train --help");
  StatusOr<TrainCommandLine> help = ParseTrainCommandLine({"--help"});
  REQUIRE(help.ok());
  CHECK(help->help_text.find("--parallel.mode") != std::string::npos);
  CHECK(help->help_text.find("none | dp | ddp | pipeline") != std::string::npos);
}

TEST_CASE("ValidatePrecedenceRanksAFlagAboveADerivedValue") {
  // nproc_per_node derived from num_processes (kDerived) must not outrank a later flag.
  LaunchConfig cfg;
  REQUIRE(LoadYamlString("num_processes: 4\n", "t.yaml", &cfg).ok());
  cfg.origins["nproc_per_node"] = Origin{Origin::Kind::kDerived, "earlier"};
  cfg.nproc_per_node = "4";
  REQUIRE(ApplySetting("num_processes", "2", Origin{Origin::Kind::kFlag, "--num_processes"}, &cfg)
              .ok());
  REQUIRE(Validate(&cfg).ok());
  CHECK(cfg.nproc_per_node == "2");
}

}  // namespace
}  // namespace launch::config
