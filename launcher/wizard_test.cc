#include "launcher/wizard.h"

#include "base/files.h"

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

#include "base/test_util.h"
#include "config/loader.h"
#include "launcher/terminal.h"

namespace launch::launcher {
namespace {

using config::DistributedType;
using config::LaunchConfig;

// Loads what the wizard would write, as `launch` would, and validates it.
LaunchConfig LoadRendered(const ConfigAnswers& answers) {
  std::string text = RenderConfigYaml(answers);
  LaunchConfig cfg;
  Status s = config::LoadYamlString(text, "rendered.yaml", &cfg);
  REQUIRE_MESSAGE(s.ok(), (s.ToString() + "\n" + text));
  s = config::Validate(&cfg);
  REQUIRE_MESSAGE(s.ok(), (s.ToString() + "\n" + text));
  CHECK_MESSAGE(cfg.warnings.empty(), text);
  return cfg;
}

TEST_CASE("DefaultAnswersRenderALoadableCommentedConfig") {
  ConfigAnswers answers;
  std::string text = RenderConfigYaml(answers);
  CHECK(text.find("# ") == 0);
  CHECK(text.find("distributed_type: MULTI_CPU") != std::string::npos);
  CHECK(text.find("nproc_per_node: auto") != std::string::npos);
  LaunchConfig cfg = LoadRendered(answers);
  CHECK(cfg.distributed_type == DistributedType::kMultiCpu);
  CHECK(cfg.min_nodes == 1);
  CHECK(cfg.machine_rank == 0);
  CHECK(cfg.main_process_port == -1);  // a free port per run on one machine
  CHECK(cfg.nproc_per_node == "auto");
  CHECK(cfg.mixed_precision == "no");
  CHECK(!cfg.train.present);
}

TEST_CASE("ClusterAnswersGiveAccelerateTotalProcesses") {
  ConfigAnswers a;
  a.where = ConfigAnswers::Where::kCluster;
  a.use_gpu = true;
  a.num_machines = 2;
  a.machine_rank = 1;
  a.main_process_ip = "10.1.2.3";
  a.main_process_port = 29555;
  a.nproc_per_node = "4";
  a.gpu_ids = "0,1,2,3";
  a.mixed_precision = "bf16";
  a.max_restarts = 3;
  a.rdzv_token = "s3cr3t:with#chars";
  LaunchConfig cfg = LoadRendered(a);
  CHECK(cfg.distributed_type == DistributedType::kMultiGpu);
  CHECK(cfg.num_processes == 8);  // accelerate's meaning: total
  CHECK(cfg.nproc_per_node == "4");
  CHECK(cfg.min_nodes == 2);
  CHECK(cfg.machine_rank == 1);
  CHECK(cfg.main_process_ip == "10.1.2.3");
  CHECK(cfg.main_process_port == 29555);
  CHECK(cfg.gpu_ids == "0,1,2,3");
  CHECK(cfg.mixed_precision == "bf16");
  CHECK(cfg.max_restarts == 3);
  CHECK(cfg.rdzv_token == "s3cr3t:with#chars");
}

TEST_CASE("SlurmAnswersLeaveMachinesToSlurm") {
  ConfigAnswers a;
  a.where = ConfigAnswers::Where::kSlurm;
  a.nproc_per_node = "2";
  a.main_process_port = 29600;
  std::string text = RenderConfigYaml(a);
  CHECK(text.find("\nnum_machines:") == std::string::npos);
  CHECK(text.find("\nmachine_rank:") == std::string::npos);
  LaunchConfig cfg = LoadRendered(a);
  CHECK(cfg.nproc_per_node == "2");
  CHECK(cfg.main_process_port == 29600);
  CHECK(cfg.origins.count("num_machines") == 0);
}

TEST_CASE("TrainerAnswersRenderEveryMode") {
  std::string dir = testing::MakeTempDir("wizard-test");
  std::string csv = dir + "/data.csv";
  {
    std::ofstream out(csv);
    out << "a,b,c,label\n1,2,3,0\n4,5,6,2\n";
  }
  std::string corpus = dir + "/corpus.txt";
  { std::ofstream(corpus) << "hello world\n"; }

  ConfigAnswers a;
  a.train = true;
  a.output_dir = "runs/my run";
  a.gradient_accumulation_steps = 4;
  a.batch_size = 16;
  a.max_steps = 50;
  LaunchConfig mlp = LoadRendered(a);
  CHECK(mlp.train.present);
  CHECK(mlp.train.output_dir == "runs/my run");
  CHECK(mlp.train.parallel.mode == config::ParallelMode::kDdp);
  CHECK(mlp.train.gradient_accumulation_steps == 4);
  CHECK(mlp.train.batch_size == 16);
  CHECK(mlp.train.max_steps == 50);
  CHECK(mlp.train.data.type == config::DataType::kSynthetic);

  a.data = "csv";
  a.data_path = csv;
  a.parallel_mode = "pipeline";
  a.stages = 2;
  a.microbatches = 4;
  a.nproc_per_node = "2";
  LaunchConfig from_csv = LoadRendered(a);
  CHECK(from_csv.train.data.type == config::DataType::kCsv);
  CHECK(from_csv.train.data.path == csv);
  // Three feature columns in, labels 0..2 out.
  CHECK(from_csv.train.model.mlp_layers == std::vector<int64_t>{3, 256, 256, 3});
  CHECK(from_csv.train.parallel.mode == config::ParallelMode::kPipeline);
  CHECK(from_csv.train.parallel.stages == 2);

  a.model = "transformer";
  a.data = "text";
  a.data_path = corpus;
  a.parallel_mode = "dp";
  LaunchConfig text = LoadRendered(a);
  CHECK(text.train.model.type == config::ModelType::kTransformer);
  CHECK(text.train.data.type == config::DataType::kText);
  CHECK(text.train.parallel.mode == config::ParallelMode::kDp);
  CHECK(text.nproc_per_node == "1");  // dp drives its replicas from one process

  // The transformer split over 2 processes, inside pipeline stages: tensor 2 x stages 2.
  a.parallel_mode = "pipeline";
  a.tensor = 2;
  a.nproc_per_node = "4";
  LaunchConfig split = LoadRendered(a);
  CHECK(split.train.parallel.tensor == 2);
  CHECK(split.train.parallel.stages == 2);
  a.tensor = 1;

  a.model = "cnn";
  a.data = "idx";
  a.data_path = dir;  // a folder (the loader checks it is one)
  a.parallel_mode = "ddp";
  LaunchConfig images = LoadRendered(a);
  CHECK(images.train.model.type == config::ModelType::kCnn);
  CHECK(images.train.data.type == config::DataType::kIdx);
  CHECK(images.train.data.path == dir);
}

TEST_CASE("LoadAnswersReadsBackWhatWasWritten") {
  std::string dir = testing::MakeTempDir("wizard-test");
  std::string corpus = dir + "/corpus.txt";
  { std::ofstream(corpus) << "hello\n"; }
  ConfigAnswers a;
  a.where = ConfigAnswers::Where::kCluster;
  a.use_gpu = true;
  a.num_machines = 4;
  a.machine_rank = 2;
  a.main_process_ip = "head.example.org";
  a.main_process_port = 31000;
  a.nproc_per_node = "8";
  a.gpu_ids = "1,0";
  a.mixed_precision = "fp16";
  a.max_restarts = 2;
  a.rdzv_token = "abc";
  a.train = true;
  a.model = "transformer";
  a.data = "text";
  a.data_path = corpus;
  a.parallel_mode = "pipeline";
  a.stages = 4;
  a.microbatches = 8;
  a.tensor = 2;
  a.gradient_accumulation_steps = 3;
  a.batch_size = 7;
  a.max_steps = 99;
  a.output_dir = "runs/x";
  std::string path = dir + "/c.yaml";
  REQUIRE(WriteFileAtomically(path, RenderConfigYaml(a)).ok());
  StatusOr<ConfigAnswers> back = LoadAnswers(path);
  REQUIRE_MESSAGE(back.ok(), (back.status().ToString()));
  CHECK(back->where == a.where);
  CHECK(back->use_gpu);
  CHECK(back->num_machines == 4);
  CHECK(back->machine_rank == 2);
  CHECK(back->main_process_ip == a.main_process_ip);
  CHECK(back->main_process_port == 31000);
  CHECK(back->nproc_per_node == "8");
  CHECK(back->gpu_ids == "1,0");
  CHECK(back->mixed_precision == "fp16");
  CHECK(back->max_restarts == 2);
  CHECK(back->rdzv_token == "abc");
  CHECK(back->train);
  CHECK(back->model == "transformer");
  CHECK(back->data == "text");
  CHECK(back->data_path == corpus);
  CHECK(back->parallel_mode == "pipeline");
  CHECK(back->stages == 4);
  CHECK(back->microbatches == 8);
  CHECK(back->tensor == 2);
  CHECK(back->gradient_accumulation_steps == 3);
  CHECK(back->batch_size == 7);
  CHECK(back->max_steps == 99);
  CHECK(back->output_dir == "runs/x");
  // Rendering the answers read back gives the same file (apart from the date line).
  CHECK(RenderConfigYaml(*back) == RenderConfigYaml(a));

  ConfigAnswers slurm;
  slurm.where = ConfigAnswers::Where::kSlurm;
  slurm.main_process_port = 29700;
  REQUIRE(WriteFileAtomically(path, RenderConfigYaml(slurm)).ok());
  back = LoadAnswers(path);
  REQUIRE(back.ok());
  CHECK(back->where == ConfigAnswers::Where::kSlurm);
  CHECK(back->nproc_per_node == "auto");

  REQUIRE(WriteFileAtomically(path, "num_procesess: 2\n").ok());
  CHECK(LoadAnswers(path).status().code() == Status::Code::kInvalidConfig);
}

// Writes `a`, reads the answers back and checks they render the same file.
ConfigAnswers RoundTrip(const ConfigAnswers& a) {
  std::string path = testing::MakeTempDir("wizard-test") + "/c.yaml";
  REQUIRE(WriteFileAtomically(path, RenderConfigYaml(a)).ok());
  StatusOr<ConfigAnswers> back = LoadAnswers(path);
  REQUIRE_MESSAGE(back.ok(), (back.status().ToString()));
  CHECK(RenderConfigYaml(*back) == RenderConfigYaml(a));
  return *back;
}

TEST_CASE("ShardingChoicesRenderAndReadBack") {
  ConfigAnswers trainer;
  trainer.train = true;
  trainer.parallel_mode = "zero";
  trainer.zero_stage = 2;
  LaunchConfig zero = LoadRendered(trainer);
  CHECK(zero.train.parallel.mode == config::ParallelMode::kZero);
  CHECK(zero.train.parallel.zero_stage == 2);
  CHECK(RoundTrip(trainer).zero_stage == 2);

  trainer.parallel_mode = "ddp";
  trainer.local_sgd_steps = 8;
  LaunchConfig local_sgd = LoadRendered(trainer);
  CHECK(local_sgd.train.parallel.mode == config::ParallelMode::kDdp);
  CHECK(local_sgd.train.local_sgd_steps == 8);
  CHECK(RoundTrip(trainer).local_sgd_steps == 8);

  // Without train:, the script's Accelerator shards: accelerate's keys, mapped by launch.
  ConfigAnswers script;
  script.use_gpu = true;
  script.sharding = "fsdp";
  script.fsdp_strategy = "SHARD_GRAD_OP";
  LaunchConfig fsdp = LoadRendered(script);
  CHECK(fsdp.distributed_type == DistributedType::kFsdp);
  CHECK(fsdp.accelerate["fsdp_sharding_strategy"] == "SHARD_GRAD_OP");
  CHECK(RoundTrip(script).fsdp_strategy == "SHARD_GRAD_OP");

  script.sharding = "deepspeed";
  script.deepspeed_zero_stage = 3;
  LaunchConfig deepspeed = LoadRendered(script);
  CHECK(deepspeed.distributed_type == DistributedType::kDeepSpeed);
  CHECK(deepspeed.accelerate["zero_stage"] == "3");
  CHECK(RoundTrip(script).deepspeed_zero_stage == 3);

  // With train:, the trainer's own parallel mode decides: no FSDP or DeepSpeed keys.
  script.train = true;
  CHECK(LoadRendered(script).distributed_type == DistributedType::kMultiGpu);
}

TEST_CASE("DefaultConfigPathFollowsXdgThenHome") {
  CHECK(DefaultConfigPath({{"XDG_CONFIG_HOME", "/x/cfg"}, {"HOME", "/home/u"}}) ==
        "/x/cfg/launch/default_config.yaml");
  // A relative XDG_CONFIG_HOME is invalid per the XDG spec and ignored.
  CHECK(DefaultConfigPath({{"XDG_CONFIG_HOME", "rel"}, {"HOME", "/home/u/"}}) ==
        "/home/u/.config/launch/default_config.yaml");
  CHECK(DefaultConfigPath({{"HOME", "/root"}}) == "/root/.config/launch/default_config.yaml");
  CHECK(DefaultConfigPath(std::map<std::string, std::string>{}).empty());
}

TEST_CASE("DefaultConfigCandidatesAreOursThenAcceleratesInItsOrder") {
  using V = std::vector<std::string>;
  CHECK(DefaultConfigCandidates({{"HOME", "/home/u"}}) ==
        V{"/home/u/.config/launch/default_config.yaml",
          "/home/u/.cache/huggingface/accelerate/default_config.yaml",
          "/home/u/.cache/huggingface/accelerate/default_config.json"});
  CHECK(DefaultConfigCandidates({{"HOME", "/home/u"}, {"XDG_CACHE_HOME", "/c"}})[1] ==
        "/c/huggingface/accelerate/default_config.yaml");
  CHECK(DefaultConfigCandidates(
            {{"HOME", "/home/u"}, {"XDG_CACHE_HOME", "/c"}, {"HF_HOME", "~/hf"}})[1] ==
        "/home/u/hf/accelerate/default_config.yaml");
  CHECK(DefaultConfigCandidates(std::map<std::string, std::string>{}).empty());
}

// A pipe pair fed with `keys`: the same byte sequences a terminal sends.
struct Pipes {
  int in[2];
  int out[2];
  explicit Pipes(const std::string& keys) {
    REQUIRE(pipe(in) == 0);
    REQUIRE(pipe(out) == 0);
    REQUIRE(write(in[1], keys.data(), keys.size()) == static_cast<ssize_t>(keys.size()));
    close(in[1]);
  }
  ~Pipes() {
    close(in[0]);
    close(out[0]);
    close(out[1]);
  }
  std::string Output() {
    close(out[1]);
    out[1] = -1;
    std::string text;
    char buf[4096];
    ssize_t n;
    while ((n = read(out[0], buf, sizeof(buf))) > 0) text.append(buf, static_cast<size_t>(n));
    return text;
  }
};

// Prompts answered through Pipes.
struct PipePrompter : Pipes {
  explicit PipePrompter(const std::string& keys) : Pipes(keys) {}
  Terminal term{in[0], out[1]};
  Prompter p{&term};
};

TEST_CASE("MenuMovesWithArrowsAndNumbers") {
  const std::vector<std::string> options = {"a", "b", "c"};
  {
    PipePrompter io("\x1b[B\x1b[B\x1b[A\r");  // down, down, up: "b"
    StatusOr<int> choice = io.p.Choose("Pick", options, 0);
    REQUIRE(choice.ok());
    CHECK(*choice == 1);
  }
  {
    PipePrompter io("3\r");
    StatusOr<int> choice = io.p.Choose("Pick", options, 0);
    REQUIRE(choice.ok());
    CHECK(*choice == 2);
  }
  {
    PipePrompter io("\x1b[A\r");  // up from the first wraps to the last
    StatusOr<int> choice = io.p.Choose("Pick", options, 0);
    REQUIRE(choice.ok());
    CHECK(*choice == 2);
  }
  {
    PipePrompter io("\r");  // Enter takes the default
    StatusOr<int> choice = io.p.Choose("Pick", options, 1);
    REQUIRE(choice.ok());
    CHECK(*choice == 1);
  }
}

TEST_CASE("AskReasksAfterAnInvalidAnswer") {
  PipePrompter io("two\r5\r\r");
  StatusOr<int> n = io.p.AskInt("How many?", 2, 1, 4);
  REQUIRE(n.ok());
  CHECK(*n == 2);  // "two" rejected, 5 out of range, then Enter takes the default
  std::string shown = io.Output();
  CHECK(shown.find("'two' is not a whole number") != std::string::npos);
  CHECK(shown.find("expected a number from 1 to 4, got 5") != std::string::npos);
  CHECK(shown.find("How many? [2]") != std::string::npos);
}

TEST_CASE("AskEditsWithBackspaceAndCtrlUByColumns") {
  PipePrompter io(
      "10.0.0.9\x7f"
      "1\r"
      "h\xc3\xa9llo\x15"
      "ok\r");
  StatusOr<std::string> ip = io.p.Ask("Address?", "", nullptr);
  REQUIRE(ip.ok());
  CHECK(*ip == "10.0.0.1");
  StatusOr<std::string> name = io.p.Ask("Name?", "", nullptr);
  REQUIRE(name.ok());
  CHECK(*name == "ok");
  // "héllo" is six bytes and five columns: Ctrl-U moves back five, as far as the line goes.
  CHECK(io.Output().find("h\xc3\xa9llo\b\b\b\b\b     \b\b\b\b\bok") != std::string::npos);
}

TEST_CASE("SecretIsNotEchoedAndKeepsTheCurrentOneOnEnter") {
  PipePrompter io(
      "s3cr\x7f"
      "et\r\r");
  StatusOr<std::string> typed = io.p.AskSecret("Token?", "", nullptr);
  REQUIRE(typed.ok());
  CHECK(*typed == "s3cet");  // Backspace edits what is not shown
  StatusOr<std::string> kept = io.p.AskSecret("Token?", "older", nullptr);
  REQUIRE(kept.ok());
  CHECK(*kept == "older");
  std::string shown = io.Output();
  CHECK(shown.find("s3c") == std::string::npos);
  CHECK(shown.find("older") == std::string::npos);
  CHECK(shown.find("Token? [Enter keeps the current one]: ") != std::string::npos);
}

TEST_CASE("ConfirmShowsDefaultAndAcceptsYesNo") {
  PipePrompter io("maybe\ry\r\r");
  StatusOr<bool> first = io.p.Confirm("Go?", false);
  REQUIRE(first.ok());
  CHECK(*first);
  StatusOr<bool> second = io.p.Confirm("Again?", false);
  REQUIRE(second.ok());
  CHECK(!*second);
  std::string shown = io.Output();
  CHECK(shown.find("Go? [yes/NO]") != std::string::npos);
  CHECK(shown.find("please answer yes or no, not 'maybe'") != std::string::npos);
}

TEST_CASE("CtrlCAndEndOfInputInterrupt") {
  {
    PipePrompter io("12\x03");
    StatusOr<std::string> a = io.p.Ask("Q?", "x", nullptr);
    CHECK(a.status().code() == Status::Code::kInterrupted);
  }
  {
    PipePrompter io("");  // the input ends before an answer
    StatusOr<int> c = io.p.Choose("Pick", {"a", "b"}, 0);
    CHECK(c.status().code() == Status::Code::kInterrupted);
  }
}

}  // namespace
}  // namespace launch::launcher
