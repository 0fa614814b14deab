#include "launcher/wizard.h"

#include <fcntl.h>
#include <langinfo.h>
#include <pwd.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <clocale>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iostream>
#include <sstream>
#include <utility>

#include "base/check.h"
#include "base/environment.h"
#include "base/exit_code.h"
#include "base/files.h"
#include "base/host.h"
#include "base/strings.h"
#include "config/help_format.h"
#include "config/loader.h"
#include "config/train_keys.h"
#include "launcher/subcommand_args.h"
#include "launcher/terminal.h"

namespace launch::launcher {
namespace {

using Where = ConfigAnswers::Where;

// Exit codes (base/exit_code.h): written, not written, usage, interrupted by Ctrl-C.
constexpr int kExitWritten = kExitOk;
constexpr int kExitNotWritten = kExitFailure;
constexpr int kExitInterrupted = ExitCodeForSignal(SIGINT);

bool FileExists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

std::string AbsolutePath(const std::string& path) {
  char buf[PATH_MAX];
  if (realpath(path.c_str(), buf)) return buf;
  return path;
}

// A scalar for YAML::Emitter, and how it is written: as YAML text of its own type (42, 1.0,
// true, auto, MULTI_GPU), or as a string that must read back as one.
struct Scalar {
  std::string text;
  enum class Style { kRaw, kText, kQuoted } style = Style::kRaw;
};
Scalar Raw(const std::string& yaml) { return {yaml, Scalar::Style::kRaw}; }
Scalar Raw(long long n) { return {std::to_string(n), Scalar::Style::kRaw}; }
// Single-quoted where YAML would read it as something else (a number, a bool, null) or it holds
// more than letters, digits and "._-/"; plain otherwise.
Scalar Text(const std::string& s) { return {s, Scalar::Style::kText}; }
// Always single-quoted (mixed_precision: 'no' is not the bool no).
Scalar Quoted(const std::string& s) { return {s, Scalar::Style::kQuoted}; }

bool NeedsQuotes(const std::string& s) {
  if (s.empty()) return true;
  for (char c : s)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-' &&
        c != '/')
      return true;
  std::string l = ToLower(s);
  if (l == "no" || l == "yes" || l == "on" || l == "off" || l == "true" || l == "false" ||
      l == "null" || l == "~")
    return true;
  long long ignored = 0;
  return ParseInt64(s, &ignored);
}

YAML::Emitter& operator<<(YAML::Emitter& y, const Scalar& v) {
  if (v.style == Scalar::Style::kQuoted || (v.style == Scalar::Style::kText && NeedsQuotes(v.text)))
    y << YAML::SingleQuoted;
  return y << v.text;
}

// A comment after the current line's value: at column 38, so that the comments line up, or two
// spaces after a longer line.
void Trailing(YAML::Emitter& y, const std::string& comment) {
  if (comment.empty()) return;
  const std::string text = y.c_str();
  const size_t newline = text.rfind('\n');
  const size_t column = newline == std::string::npos ? text.size() : text.size() - newline - 1;
  y.SetPreCommentIndent(column < 36 ? 38 - column : 2);
  y << YAML::Comment(comment);
}

// A comment on lines of its own (a setting left out, what comes next).
void OwnLine(YAML::Emitter& y, const std::string& comment) {
  y << YAML::Newline << YAML::Comment(comment);
}

// "key: value  # comment" in the current block map.
void Entry(YAML::Emitter& y, const std::string& key, const Scalar& value,
           const std::string& comment) {
  y << YAML::Key << key << YAML::Value << value;
  Trailing(y, comment);
}

// key: value pairs in the current flow map ({type: cnn, ...}).
void FlowEntries(YAML::Emitter& y, std::initializer_list<std::pair<const char*, Scalar>> entries) {
  for (const auto& [key, value] : entries) y << YAML::Key << key << YAML::Value << value;
}

// The emitter's text, ending with a newline as a file does; a broken emitter is a bug here.
std::string Finish(const YAML::Emitter& y) {
  LAUNCH_CHECK(y.good(), "YAML::Emitter: " + y.GetLastError());
  return std::string(y.c_str()) + "\n";
}

std::string Today() {
  std::time_t now = std::time(nullptr);
  char buf[32];
  struct tm tm_now {};
  localtime_r(&now, &tm_now);
  std::strftime(buf, sizeof(buf), "%Y-%m-%d", &tm_now);
  return buf;
}

// The input width and class count of an MLP for a CSV file: columns other than the label, and
// 1 + the largest integer label (1 when labels are not integers: a regression target).
void CsvShape(const std::string& path, const std::string& label_column, int* inputs, int* outputs) {
  *inputs = 32;
  *outputs = 10;
  std::ifstream in(path);
  std::string header;
  if (!in || !std::getline(in, header)) return;
  std::vector<std::string> columns = Split(header, ',');
  int label_index = -1;
  for (size_t i = 0; i < columns.size(); ++i)
    if (Trim(columns[i]) == label_column) label_index = static_cast<int>(i);
  if (label_index < 0 || columns.size() < 2) return;
  *inputs = static_cast<int>(columns.size()) - 1;
  long long max_label = -1;
  bool integral = true;
  std::string row;
  for (int rows = 0; rows < 100000 && std::getline(in, row); ++rows) {
    std::vector<std::string> cells = Split(row, ',');
    if (static_cast<int>(cells.size()) <= label_index) continue;
    long long v = 0;
    if (!ParseInt64(Trim(cells[static_cast<size_t>(label_index)]), &v) || v < 0) {
      integral = false;
      break;
    }
    max_label = std::max(max_label, v);
  }
  *outputs = integral && max_label >= 0 ? static_cast<int>(max_label + 1) : 1;
}

// Checks one answer with the loader's own rules for `key` (one source of truth for what a
// valid value is); returns "" or the loader's complaint without its location prefix.
std::string CheckSetting(const std::string& key, const std::string& value) {
  config::LaunchConfig scratch;
  Status s =
      config::ApplySetting(key, value, config::Origin{config::Origin::Kind::kFlag, key}, &scratch);
  if (s.ok()) return "";
  std::string msg = s.message();
  if (StartsWith(msg, key + ": ")) msg = msg.substr(key.size() + 2);
  return msg;
}

std::string CheckReadableFile(const std::string& path) {
  if (path.empty()) return "a file path is needed";
  std::ifstream probe(path);
  if (!probe) return "cannot read '" + path + "'";
  return "";
}

std::string CheckDirectory(const std::string& path) {
  if (path.empty()) return "a folder is needed";
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec)) return "'" + path + "' is not a folder";
  return "";
}

std::string CheckHost(const std::string& host) {
  if (host.empty()) return "the address of the main machine is needed (an IP or a host name)";
  for (char c : host)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == ':' ||
          c == '_'))
      return "'" + host + "' is not an IP address or a host name";
  return "";
}

// ---------------------------------------------------------------------------------------------
// The questions.

// Index of `value` in `items`, or 0.
int IndexOf(const std::vector<std::string>& items, const std::string& value) {
  for (size_t i = 0; i < items.size(); ++i)
    if (items[i] == value) return static_cast<int>(i);
  return 0;
}

// Every question's default is the current value in `a`: the built-in defaults, or the answers
// read back from an existing file (`from_file`).
Status AskMachine(Prompter& p, int gpus, bool from_file, ConfigAnswers* a) {
  LAUNCH_ASSIGN_OR_RETURN(
      int where, p.Choose("Where will the job run?",
                          {"on this machine only",
                           "on several machines (one launch per machine; I give the addresses)",
                           "on a SLURM cluster (one launch per node under srun)"},
                          static_cast<int>(a->where)));
  a->where = static_cast<Where>(where);
  if (a->where == Where::kCluster) {
    LAUNCH_ASSIGN_OR_RETURN(
        a->num_machines, p.AskInt("How many machines?", std::max(2, a->num_machines), 2, 100000));
    LAUNCH_ASSIGN_OR_RETURN(
        a->machine_rank,
        p.AskInt("What is the rank of this machine? (0 is the main machine)",
                 std::min(a->machine_rank, a->num_machines - 1), 0, a->num_machines - 1));
    std::string ip_default =
        from_file && !IsLoopbackHost(a->main_process_ip) ? a->main_process_ip : "";
    while (true) {
      LAUNCH_ASSIGN_OR_RETURN(
          a->main_process_ip,
          p.Ask("What is the IP address (or host name) of the main machine, rank 0?", ip_default,
                CheckHost));
      if (!IsLoopbackHost(a->main_process_ip)) break;
      // Every machine dials this address, and on each of them loopback is the machine itself.
      // accelerate takes it silently; it is right only for several launches on one host.
      p.Warn(a->main_process_ip + " is a loopback address: the other machines cannot reach it");
      LAUNCH_ASSIGN_OR_RETURN(
          bool keep,
          p.Confirm("Keep it anyway? (only for trying the job with several launches on this "
                    "one machine)",
                    false));
      if (keep) break;
    }
  }
  if (a->where != Where::kThisMachine) {
    LAUNCH_ASSIGN_OR_RETURN(
        a->main_process_port,
        p.AskInt("Which port should the rendezvous use on the main machine?",
                 a->main_process_port > 0 ? a->main_process_port : 29500, 1, 65535));
    LAUNCH_ASSIGN_OR_RETURN(
        a->rdzv_token,
        p.AskSecret("A shared secret for the rendezvous? (typing is not shown; empty: none, or "
                    "set LAUNCH_RDZV_TOKEN)",
                    a->rdzv_token, [](const std::string& s) {
                      for (char c : s)
                        if (std::isspace(static_cast<unsigned char>(c)))
                          return std::string("the secret may not contain spaces");
                      return std::string();
                    }));
  }

  LAUNCH_ASSIGN_OR_RETURN(int device,
                          p.Choose("Which devices should the workers use?",
                                   {"CPUs (Gloo backend)", "NVIDIA GPUs (NCCL backend)"},
                                   (from_file ? a->use_gpu : gpus > 0) ? 1 : 0));
  a->use_gpu = device == 1;
  if (a->use_gpu && gpus == 0)
    p.Say("  (no NVIDIA GPU is visible on this machine; fine if the job runs elsewhere)");

  std::string ppn_default = from_file                ? a->nproc_per_node
                            : a->use_gpu && gpus > 0 ? std::to_string(gpus)
                                                     : "auto";
  LAUNCH_ASSIGN_OR_RETURN(
      a->nproc_per_node,
      p.Ask(std::string("How many processes per machine? ('auto': one per ") +
                (a->use_gpu ? "GPU"
                            : "CPU core, " + std::to_string(ProbeHost().cpu_slots) + " here") +
                ")",
            ppn_default, [](const std::string& s) {
              std::string l = ToLower(s);
              if (l == "auto") return std::string();
              long long v = 0;
              if (!ParseInt64(l, &v) || v < 1 || v > 4096)
                return "expected a number from 1 to 4096 or 'auto', got '" + s + "'";
              return std::string();
            }));
  a->nproc_per_node = ToLower(a->nproc_per_node);

  if (a->use_gpu) {
    LAUNCH_ASSIGN_OR_RETURN(
        a->gpu_ids, p.Ask("Which GPUs should be used? (ids like 0,1,3, or 'all')", a->gpu_ids,
                          [](const std::string& s) { return CheckSetting("gpu_ids", s); }));
  }
  std::vector<std::string> precisions = {"no", "bf16"};
  if (a->use_gpu) precisions.push_back("fp16");
  LAUNCH_ASSIGN_OR_RETURN(int precision, p.Choose("Mixed precision?", precisions,
                                                  IndexOf(precisions, a->mixed_precision)));
  a->mixed_precision = precisions[static_cast<size_t>(precision)];
  LAUNCH_ASSIGN_OR_RETURN(a->max_restarts,
                          p.AskInt("How many times should the job restart after a failure?",
                                   a->max_restarts, 0, 10000));
  return Status::Ok();
}

Status AskTrainer(Prompter& p, ConfigAnswers* a) {
  LAUNCH_ASSIGN_OR_RETURN(
      a->train,
      p.Confirm("Also set up the built-in trainer (model, data, parallel mode)?", a->train));
  if (!a->train) return Status::Ok();
  const std::vector<std::string> models = {"mlp", "cnn", "transformer", "torchscript"};
  LAUNCH_ASSIGN_OR_RETURN(int model,
                          p.Choose("Which model?",
                                   {"MLP (a multi-layer perceptron)",
                                    "CNN (a convolutional net for images, e.g. Fashion-MNIST)",
                                    "Transformer (a character-level language model on text)",
                                    "TorchScript module (a .pt file saved with torch.jit.save)"},
                                   IndexOf(models, a->model)));
  a->model = models[static_cast<size_t>(model)];
  if (a->model == "torchscript") {
    LAUNCH_ASSIGN_OR_RETURN(a->torchscript_path, p.AskPath("Path of the TorchScript file?",
                                                           a->torchscript_path, CheckReadableFile));
    a->torchscript_path = AbsolutePath(a->torchscript_path);
  }
  if (a->model == "transformer") {
    a->data = "text";
  } else if (a->model == "cnn") {
    a->data = "idx";
    if (a->data_path.empty()) a->data_path = config::kFashionMnistDir;
    LAUNCH_ASSIGN_OR_RETURN(a->data_path,
                            p.AskPath("Folder of the MNIST-format image files (train-*, t10k-*)?",
                                      a->data_path, CheckDirectory));
    a->data_path = AbsolutePath(a->data_path);
  } else {
    LAUNCH_ASSIGN_OR_RETURN(int data,
                            p.Choose("Which training data?",
                                     {"synthetic (a fixed random teacher network; no files needed)",
                                      "a CSV file (numeric columns and a label column)"},
                                     a->data == "csv" ? 1 : 0));
    a->data = data == 0 ? "synthetic" : "csv";
  }
  if (a->data == "csv" || a->data == "text") {
    LAUNCH_ASSIGN_OR_RETURN(a->data_path, p.AskPath(a->data == "text" ? "Path of the text corpus?"
                                                                      : "Path of the CSV file?",
                                                    a->data_path, CheckReadableFile));
    a->data_path = AbsolutePath(a->data_path);
  }
  if (a->data == "csv") {
    LAUNCH_ASSIGN_OR_RETURN(a->label_column,
                            p.Ask("Name of the label column?", a->label_column, nullptr));
  }
  // local_sgd is ddp's process group with local_sgd_steps > 0 (config/train_keys.cc).
  const std::vector<std::string> modes = {"ddp", "zero", "local_sgd", "none", "dp", "pipeline"};
  LAUNCH_ASSIGN_OR_RETURN(
      int mode,
      p.Choose("Which parallel mode?",
               {"ddp: one replica per process, gradients all-reduced (recommended)",
                "zero: ddp with the training state sharded over the processes (less memory)",
                "local SGD: no gradient all-reduce; parameters averaged every K steps",
                "none: each process trains alone", "dp: several replicas inside one process",
                "pipeline: layers split into stages over processes"},
               IndexOf(modes, a->local_sgd_steps > 0 ? "local_sgd" : a->parallel_mode)));
  a->parallel_mode = modes[static_cast<size_t>(mode)];
  if (a->parallel_mode == "zero") {
    LAUNCH_ASSIGN_OR_RETURN(int stage,
                            p.Choose("What should zero shard?",
                                     {"stage 1: optimizer state", "stage 2: also gradients",
                                      "stage 3: also parameters between uses (FSDP's FULL_SHARD)"},
                                     std::clamp(a->zero_stage, 1, 3) - 1));
    a->zero_stage = stage + 1;
  }
  if (a->parallel_mode == "local_sgd") {
    a->parallel_mode = "ddp";
    LAUNCH_ASSIGN_OR_RETURN(a->local_sgd_steps,
                            p.AskInt("Average the parameters every how many optimizer steps?",
                                     a->local_sgd_steps > 0 ? a->local_sgd_steps : 8, 1, 1 << 20));
  } else {
    a->local_sgd_steps = 0;
  }
  if (a->parallel_mode == "pipeline") {
    LAUNCH_ASSIGN_OR_RETURN(a->stages,
                            p.AskInt("How many pipeline stages?", std::max(2, a->stages), 2, 1024));
    LAUNCH_ASSIGN_OR_RETURN(
        a->microbatches,
        p.AskInt("How many micro-batches per step? (at least the number of stages)",
                 std::max(a->microbatches, a->stages), a->stages, 1 << 20));
  }
  // The built-in transformer's 4 heads and byte vocabulary split over 1, 2 or 4 processes; dp's
  // replicas run in one process and split nothing.
  if (a->model == "transformer" && a->parallel_mode != "dp") {
    const std::vector<int> degrees = {1, 2, 4};
    LAUNCH_ASSIGN_OR_RETURN(
        int degree,
        p.Choose("Split each layer over several processes (tensor parallelism)?",
                 {"no: each process holds whole layers",
                  "over 2 processes (the world must be a multiple of 2 x the pipeline stages)",
                  "over 4 processes (the world must be a multiple of 4 x the pipeline stages)"},
                 a->tensor >= 4   ? 2
                 : a->tensor >= 2 ? 1
                                  : 0));
    a->tensor = degrees[static_cast<size_t>(degree)];
  } else {
    a->tensor = 1;
  }
  LAUNCH_ASSIGN_OR_RETURN(a->gradient_accumulation_steps,
                          p.AskInt("Gradient accumulation: micro-batches per optimizer step?",
                                   a->gradient_accumulation_steps, 1, 1 << 20));
  LAUNCH_ASSIGN_OR_RETURN(a->batch_size,
                          p.AskInt("Batch size per process?", a->batch_size, 1, 1 << 24));
  LAUNCH_ASSIGN_OR_RETURN(a->max_steps,
                          p.AskInt("How many optimizer steps?", a->max_steps, 1, INT_MAX));
  LAUNCH_ASSIGN_OR_RETURN(
      a->output_dir, p.AskPath("Directory for metrics and checkpoints?", a->output_dir, nullptr));
  return Status::Ok();
}

// accelerate's FSDP strategies, in its order; config/accelerate_keys.cc maps them for launch.
const std::vector<std::string> kFsdpStrategies = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD",
                                                  "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"};

// A GPU job without `train:` runs the user's script: its accelerate Accelerator may shard the
// model, and launch exports the choice as `accelerate launch` does.
Status AskScriptSharding(Prompter& p, ConfigAnswers* a) {
  const std::vector<std::string> kinds = {"none", "fsdp", "deepspeed"};
  LAUNCH_ASSIGN_OR_RETURN(
      int kind,
      p.Choose("Should your script's Accelerator shard the model? (accelerate's FSDP "
               "or DeepSpeed; scripts without accelerate ignore this)",
               {"no: every process holds the whole model (DDP)", "FSDP (distributed_type FSDP)",
                "DeepSpeed ZeRO (distributed_type "
                "DEEPSPEED)"},
               IndexOf(kinds, a->sharding)));
  a->sharding = kinds[static_cast<size_t>(kind)];
  if (a->sharding == "fsdp") {
    LAUNCH_ASSIGN_OR_RETURN(
        int strategy,
        p.Choose("Which FSDP sharding strategy?",
                 {"FULL_SHARD: parameters, gradients and optimizer state",
                  "SHARD_GRAD_OP: gradients and optimizer state", "NO_SHARD: nothing (DDP)",
                  "HYBRID_SHARD: FULL_SHARD within a machine, replicated across machines",
                  "HYBRID_SHARD_ZERO2: SHARD_GRAD_OP within a machine, replicated across"},
                 IndexOf(kFsdpStrategies, a->fsdp_strategy)));
    a->fsdp_strategy = kFsdpStrategies[static_cast<size_t>(strategy)];
  }
  if (a->sharding == "deepspeed") {
    LAUNCH_ASSIGN_OR_RETURN(int stage, p.Choose("Which ZeRO stage?",
                                                {"0: no sharding", "1: optimizer state",
                                                 "2: also gradients", "3: also parameters"},
                                                std::clamp(a->deepspeed_zero_stage, 0, 3)));
    a->deepspeed_zero_stage = stage;
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------

struct Args {
  bool is_default = false;
  bool force = false;
  std::string config_file;
};

const char kUsage[] =
    "usage: launch config [--config_file FILE]\n"
    "       launch config default [--config_file FILE] [--force]\n"
    "\n"
    "Asks a few questions and writes the job's YAML: accelerate's key names where accelerate\n"
    "has one, plus launch's own (nproc_per_node, max_restarts, train:), which `accelerate\n"
    "launch` refuses. launch itself also reads accelerate's own config files. `launch config\n"
    "default` writes a sensible config for this machine without questions and never\n"
    "overwrites an existing file unless --force.";

// Renders, checks that the result loads, and writes. Returns an exit code.
int Save(const ConfigAnswers& answers, const std::string& path) {
  std::string text = RenderConfigYaml(answers);
  config::LaunchConfig check;
  Status s = config::LoadYamlString(text, path, &check);
  if (s.ok()) s = config::Validate(&check);
  if (!s.ok()) {
    std::cerr << "launch config: internal error: the generated config does not load ("
              << s.message() << "); nothing was written\n";
    return kExitNotWritten;
  }
  s = WriteFileAtomically(path, text, {answers.rdzv_token.empty() ? 0644u : 0600u});
  if (!s.ok()) {
    std::cerr << "launch config: " << s.message() << "\n";
    return kExitNotWritten;
  }
  return kExitWritten;
}

std::string NextCommand(const ConfigAnswers& a, const std::string& path, bool is_default_path) {
  std::string cfg = is_default_path ? "" : " --config_file " + path;
  // The script form: launch runs a .py file as torchrun does, `python3 -u` (unbuffered, so
  // print() output shows while the worker runs), where `-- python3 train.py` would be buffered.
  std::string program = a.train ? "" : " train.py";
  std::ostringstream out;
  out << "Next:\n";
  switch (a.where) {
    case Where::kThisMachine:
      out << "  launch" << cfg << program << "\n";
      break;
    case Where::kCluster:
      out << "  launch" << cfg << program << "      # on this machine (rank " << a.machine_rank
          << ")\n"
          << "  launch --config_file " << path << " --machine_rank R" << program
          << "   # on each other machine (copy the file there), R = its rank\n";
      break;
    case Where::kSlurm:
      out << "  srun --ntasks-per-node=1 launch --config_file " << path << program
          << "   # inside an sbatch script; templates in scripts/slurm/\n";
      break;
  }
  if (!a.train)
    out << "  (replace `train.py` with your script and its arguments; a program that is not "
           "Python goes after `--`: `launch -- ./prog ARGS`)\n";
  return out.str();
}

int RunDefault(const Args& args, const std::string& path) {
  if (FileExists(path) && !args.force) {
    std::cerr << "launch config default: " << path
              << " already exists; nothing was written (use --force to overwrite it, or "
                 "--config_file to write elsewhere)\n";
    return kExitNotWritten;
  }
  ConfigAnswers answers;
  answers.use_gpu = VisibleGpus(ProbeHost().gpus, CurrentEnvironment()) > 0;
  bool existed = FileExists(path);
  int rc = Save(answers, path);
  if (rc == kExitWritten)
    std::cout << (existed ? "Overwrote " : "Wrote ") << path << " ("
              << (answers.use_gpu ? "MULTI_GPU, one process per GPU"
                                  : "MULTI_CPU, one process per CPU core")
              << ")\n";
  return rc;
}

int RunWizard(const std::string& path, bool is_default_path) {
  if (!Terminal::IsTerminal(0)) {
    std::cerr << "launch config: the wizard needs a terminal, and standard input is not one.\n"
                 "Write a config without questions with `launch config default` (then edit it),\n"
                 "or write the YAML by hand (its keys: docs/launcher.md#the-yaml).\n";
    return kExitUsage;
  }
  // Answers are UTF-8 (so is the file); libedit decodes and measures typed characters by
  // LC_CTYPE, so a terminal left in the C locale still edits an 'é' as one character.
  std::setlocale(LC_CTYPE, "");
  if (std::strcmp(nl_langinfo(CODESET), "UTF-8") != 0) std::setlocale(LC_CTYPE, "C.UTF-8");
  Terminal term(0, 1);
  Status s = term.EnterRawMode();
  if (!s.ok()) {
    std::cerr << "launch config: " << s.message() << "\n";
    return kExitNotWritten;
  }
  Prompter p(&term);
  p.Say("launch config: a few questions, then the answers are written to " + path + ".");
  p.Say("Press Enter to take the [default]; Ctrl-C to quit without writing anything.\n");
  ConfigAnswers answers;
  bool from_file = false;
  if (FileExists(path)) {
    StatusOr<ConfigAnswers> previous = LoadAnswers(path);
    if (previous.ok()) {
      answers = *previous;
      from_file = true;
      p.Say("The defaults below are the answers in the existing " + path + ".\n");
    } else {
      p.Say("(" + path + " exists but does not load: " + previous.status().message() +
            "; it is replaced only if you say so at the end)\n");
    }
  }
  s = AskMachine(p, VisibleGpus(ProbeHost().gpus, CurrentEnvironment()), from_file, &answers);
  if (s.ok()) s = AskTrainer(p, &answers);
  if (s.ok() && answers.use_gpu && !answers.train) s = AskScriptSharding(p, &answers);
  bool overwrite = true;
  if (s.ok() && FileExists(path)) {
    p.Say("Replacing " + path + " drops any keys the wizard does not ask about (log_dir, " +
          "rdzv_conf, ...).");
    StatusOr<bool> yes = p.Confirm(path + " exists. Overwrite it?", false);
    if (yes.ok()) {
      overwrite = *yes;
    } else {
      s = yes.status();
    }
  }
  term.Restore();
  if (!s.ok()) {
    if (s.code() == Status::Code::kInterrupted) {
      std::cout << "\nInterrupted; nothing was written.\n" << std::flush;
      return kExitInterrupted;
    }
    std::cerr << "\nlaunch config: " << s.message() << "\n";
    return kExitNotWritten;
  }
  if (!overwrite) {
    std::cout << "Nothing was written (" << path << " is unchanged).\n";
    return kExitNotWritten;
  }
  int rc = Save(answers, path);
  if (rc != kExitWritten) return rc;
  std::cout << "\nWrote " << path << "\n" << NextCommand(answers, path, is_default_path);
  if (is_default_path) std::cout << "`launch` reads this file whenever no config is given.\n";
  return kExitWritten;
}

}  // namespace

std::string DefaultConfigPath(const std::map<std::string, std::string>& env) {
  auto get = [&](const char* name) {
    auto it = env.find(name);
    return it == env.end() ? std::string() : it->second;
  };
  std::string xdg = get("XDG_CONFIG_HOME");
  if (StartsWith(xdg, "/")) return xdg + "/launch/default_config.yaml";
  std::string home = get("HOME");
  if (home.empty()) return "";
  if (EndsWith(home, "/")) home.pop_back();
  return home + "/.config/launch/default_config.yaml";
}

std::vector<std::string> DefaultConfigCandidates(const std::map<std::string, std::string>& env) {
  auto get = [&](const char* name) {
    auto it = env.find(name);
    return it == env.end() ? std::string() : it->second;
  };
  std::vector<std::string> out;
  const std::string ours = DefaultConfigPath(env);
  if (!ours.empty()) out.push_back(ours);
  // accelerate's own rule (commands/config/config_args.py): HF_HOME, else
  // $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface; then accelerate/.
  std::string home = get("HOME");
  if (EndsWith(home, "/")) home.pop_back();
  std::string hf = get("HF_HOME");
  if (hf.empty()) {
    const std::string cache = get("XDG_CACHE_HOME");
    if (!cache.empty()) {
      hf = cache + "/huggingface";
    } else if (!home.empty()) {
      hf = home + "/.cache/huggingface";
    }
  } else if (StartsWith(hf, "~/") && !home.empty()) {
    hf = home + hf.substr(1);
  }
  if (!hf.empty()) {
    out.push_back(hf + "/accelerate/default_config.yaml");
    out.push_back(hf + "/accelerate/default_config.json");
  }
  return out;
}

std::string DefaultConfigPath() {
  std::map<std::string, std::string> env = CurrentEnvironment();
  if (env["HOME"].empty()) {
    if (const struct passwd* pw = getpwuid(getuid())) env["HOME"] = pw->pw_dir;
  }
  return DefaultConfigPath(env);
}

StatusOr<ConfigAnswers> LoadAnswers(const std::string& path) {
  config::LaunchConfig c;
  LAUNCH_RETURN_IF_ERROR(config::LoadYamlFile(path, &c));
  ConfigAnswers a;
  if (c.origins.count("num_machines")) {
    a.where = c.max_nodes > 1 ? Where::kCluster : Where::kThisMachine;
  } else if (c.main_process_port > 0) {
    a.where = Where::kSlurm;  // the wizard's SLURM file leaves the machines to SLURM
  }
  a.use_gpu = config::WantsGpus(c.distributed_type);
  a.num_machines = c.max_nodes;
  a.machine_rank = std::max(0, c.machine_rank);
  a.main_process_ip = c.main_process_ip;
  if (c.main_process_port > 0) a.main_process_port = c.main_process_port;
  long long ppn = 0;
  if (c.num_processes > 0 && c.min_nodes > 0 && c.num_processes % c.min_nodes == 0) {
    a.nproc_per_node = std::to_string(c.num_processes / c.min_nodes);
  } else if (ParseInt64(c.nproc_per_node, &ppn)) {
    a.nproc_per_node = c.nproc_per_node;
  }
  a.gpu_ids = c.gpu_ids;
  a.mixed_precision = c.mixed_precision;
  a.max_restarts = c.max_restarts;
  a.rdzv_token = c.rdzv_token;
  auto accelerate = [&c](const char* arg) {
    auto it = c.accelerate.find(arg);
    return it == c.accelerate.end() ? std::string() : it->second;
  };
  if (c.distributed_type == config::DistributedType::kFsdp) {
    a.sharding = "fsdp";
    std::string strategy = accelerate("fsdp_sharding_strategy");
    if (IndexOf(kFsdpStrategies, strategy) > 0) a.fsdp_strategy = strategy;
  } else if (c.distributed_type == config::DistributedType::kDeepSpeed) {
    a.sharding = "deepspeed";
    long long stage = 0;
    if (ParseInt64(accelerate("zero_stage"), &stage) && stage >= 0 && stage <= 3)
      a.deepspeed_zero_stage = static_cast<int>(stage);
  }
  const config::TrainConfig& t = c.train;
  a.train = t.present;
  if (t.present) {
    a.model = config::ToString(t.model.type);
    a.torchscript_path = t.model.torchscript_path;
    a.data = config::ToString(t.data.type);
    a.data_path = t.data.path;
    a.label_column = t.data.label_column;
    a.parallel_mode = config::ToString(t.parallel.mode);
    a.zero_stage = t.parallel.zero_stage;
    a.local_sgd_steps = t.local_sgd_steps;
    a.stages = std::max(2, t.parallel.stages);
    a.tensor = t.parallel.tensor;
    a.microbatches = t.parallel.microbatches;
    a.gradient_accumulation_steps = t.gradient_accumulation_steps;
    a.batch_size = static_cast<int>(t.batch_size);
    if (t.max_steps > 0 && t.max_steps <= INT_MAX) a.max_steps = static_cast<int>(t.max_steps);
    a.output_dir = t.output_dir;
  }
  return a;
}

std::string RenderConfigYaml(const ConfigAnswers& a) {
  YAML::Emitter y;
  y << YAML::Comment(
      "launch configuration, written by `launch config` on " + Today() +
      ".\n"
      "Keys carry accelerate's names where accelerate has one; nproc_per_node, max_restarts,\n"
      "rdzv_token and train: are launch's own, so `accelerate launch` (which refuses unknown\n"
      "keys) does not read this file. launch reads accelerate's default_config.yaml when it has\n"
      "no file of its own.\n"
      "When launching: command-line flag > environment (SLURM, MPI, LAUNCH_*) > this file.\n"
      "`launch --print_config` shows every value in effect and where it came from.");
  y << YAML::Newline << YAML::BeginMap;
  // The script's sharding only: the trainer's is train.parallel, written below.
  const std::string sharding = a.use_gpu && !a.train ? a.sharding : "none";
  if (sharding == "fsdp") {
    Entry(y, "distributed_type", Raw("FSDP"),
          "one process per GPU; the script's Accelerator shards with FSDP");
  } else if (sharding == "deepspeed") {
    Entry(y, "distributed_type", Raw("DEEPSPEED"),
          "one process per GPU; the script's Accelerator shards with DeepSpeed");
  } else {
    Entry(y, "distributed_type", Raw(a.use_gpu ? "MULTI_GPU" : "MULTI_CPU"),
          a.use_gpu ? "one process per GPU, NCCL (MULTI_CPU: Gloo on CPUs)"
                    : "processes on CPUs, Gloo (MULTI_GPU: NCCL on GPUs)");
  }
  // dp drives all its replicas from one process (train_rules.cc refuses it across processes).
  const bool dp = a.train && a.parallel_mode == "dp";
  long long ppn = dp ? 1 : 0;
  bool fixed_ppn = dp || ParseInt64(a.nproc_per_node, &ppn);
  switch (a.where) {
    case Where::kThisMachine:
      Entry(y, "num_machines", Raw(1), "machines (nodes) in the job");
      Entry(y, "machine_rank", Raw(0), "this machine's rank; 0 is the main machine");
      Entry(y, "main_process_ip", Raw("127.0.0.1"), "the rendezvous runs on this machine");
      OwnLine(y, "main_process_port: 29500            # unset: a free port is picked for each run");
      break;
    case Where::kCluster:
      Entry(y, "num_machines", Raw(a.num_machines),
            "machines (nodes) in the job; one launch runs on each");
      Entry(y, "machine_rank", Raw(a.machine_rank),
            "this machine's rank (0 = main); --machine_rank R on the others");
      Entry(y, "main_process_ip", Text(a.main_process_ip),
            "the main machine (rank 0): the rendezvous endpoint");
      Entry(y, "main_process_port", Raw(a.main_process_port),
            "rendezvous port on the main machine (must be reachable)");
      break;
    case Where::kSlurm:
      OwnLine(y,
              "num_machines, machine_rank, main_process_ip: from SLURM under srun (SLURM_NNODES,\n"
              "SLURM_PROCID, the first host of SLURM_JOB_NODELIST); flags still win.");
      Entry(y, "main_process_port", Raw(a.main_process_port),
            "rendezvous port on the first node of the allocation");
      break;
  }
  if (fixed_ppn && a.where != Where::kSlurm) {
    Entry(y, "num_processes", Raw(ppn * a.num_machines),
          dp ? std::string("parallel.mode dp: one process drives every replica")
             : "total over all machines (accelerate's meaning): " + std::to_string(ppn) +
                   " per machine");
  } else {
    Entry(y, "nproc_per_node", Raw(a.nproc_per_node),
          a.nproc_per_node == "auto" ? "per machine: one per GPU, else one per CPU core"
                                     : "processes per machine");
  }
  if (a.use_gpu)
    Entry(y, "gpu_ids", Text(a.gpu_ids),
          "CUDA_VISIBLE_DEVICES for the workers, in this order ('all': as is)");
  Entry(y, "mixed_precision", Quoted(a.mixed_precision), "no | bf16 | fp16 (GPU)");
  Entry(y, "max_restarts", Raw(a.max_restarts), "restarts of the whole group after a failure");
  if (!a.rdzv_token.empty())
    Entry(y, "rdzv_token", Text(a.rdzv_token),
          "shared secret of the rendezvous (keep this file private)");
  else if (a.where != Where::kThisMachine)
    OwnLine(y, "rdzv_token: SECRET                  # or LAUNCH_RDZV_TOKEN in the environment");

  if (sharding == "fsdp") {
    y << YAML::Key << "fsdp_config" << YAML::Value << YAML::BeginMap;
    Entry(y, "fsdp_sharding_strategy", Raw(a.fsdp_strategy),
          "FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD | HYBRID_SHARD_ZERO2");
    y << YAML::EndMap;
  } else if (sharding == "deepspeed") {
    y << YAML::Key << "deepspeed_config" << YAML::Value << YAML::BeginMap;
    Entry(y, "zero_stage", Raw(a.deepspeed_zero_stage),
          "0 none | 1 optimizer state | 2 also gradients | 3 also parameters");
    y << YAML::EndMap;
  }

  if (!a.train) {
    y << YAML::Newline;
    OwnLine(y, "No `train:` section: run your script with `launch train.py ARGS`.");
    y << YAML::EndMap;
    return Finish(y);
  }
  y << YAML::Newline;
  OwnLine(y, "The built-in trainer (`launch` runs it when no program is given after `--`).");
  y << YAML::Key << "train" << YAML::Value << YAML::BeginMap;
  Entry(y, "seed", Raw(config::TrainDefault("seed")), "");
  Entry(y, "output_dir", Text(a.output_dir), config::TrainDoc("output_dir"));
  y << YAML::Key << "model" << YAML::Value << YAML::Flow << YAML::BeginMap;
  std::string model_comment;
  if (a.model == "transformer") {
    FlowEntries(y, {{"type", Raw("transformer")},
                    {"vocab", Raw("bytes")},
                    {"d_model", Raw(128)},
                    {"layers", Raw(4)},
                    {"heads", Raw(4)},
                    {"context", Raw(128)}});
  } else if (a.model == "cnn") {
    y << YAML::Key << "type" << YAML::Value << "cnn" << YAML::Key << "channels" << YAML::Value
      << YAML::Flow << YAML::BeginSeq << 16 << 32 << YAML::EndSeq;
    FlowEntries(y, {{"hidden", Raw(128)}, {"dropout", Raw("0.25")}});
    model_comment = "conv/BN/pool blocks, classifier";
  } else if (a.model == "torchscript") {
    FlowEntries(y, {{"torchscript", Text(a.torchscript_path)}});
  } else {
    int inputs = 32, outputs = 10;
    if (a.data == "csv") CsvShape(a.data_path, a.label_column, &inputs, &outputs);
    y << YAML::Key << "type" << YAML::Value << "mlp" << YAML::Key << "layers" << YAML::Value
      << YAML::Flow << YAML::BeginSeq << inputs << 256 << 256 << outputs << YAML::EndSeq;
    model_comment = "widths: input first, output last";
  }
  y << YAML::EndMap;
  Trailing(y, model_comment);
  y << YAML::Key << "data" << YAML::Value << YAML::Flow << YAML::BeginMap;
  if (a.data == "synthetic") {
    FlowEntries(y, {{"type", Raw("synthetic")}, {"samples", Raw(20000)}});
    y << YAML::EndMap;
    Trailing(y, "a fixed teacher network: known loss floor");
  } else if (a.data == "idx") {
    FlowEntries(y, {{"type", Raw("idx")}, {"path", Text(a.data_path)}});
    y << YAML::EndMap;
    Trailing(y, "t10k-* files: the evaluation set");
  } else if (a.data == "csv") {
    FlowEntries(y, {{"type", Raw("csv")},
                    {"path", Text(a.data_path)},
                    {"label_column", Text(a.label_column)}});
    y << YAML::EndMap;
  } else {
    FlowEntries(y, {{"type", Raw("text")}, {"path", Text(a.data_path)}, {"context", Raw(128)}});
    y << YAML::EndMap;
  }
  Entry(y, "eval_fraction", Raw(config::TrainDefault("eval_fraction")),
        "held-out share of the data");
  Entry(y, "batch_size", Raw(a.batch_size), "per process, per micro-batch");
  Entry(y, "max_steps", Raw(a.max_steps), "optimizer steps");
  y << YAML::Key << "optimizer" << YAML::Value << YAML::Flow << YAML::BeginMap;
  FlowEntries(y, {{"type", Raw(config::TrainDefault("optimizer.type"))},
                  {"lr", Raw(config::TrainDefault("optimizer.lr"))},
                  {"weight_decay", Raw("0.01")}});
  y << YAML::EndMap;
  Trailing(y, config::TrainChoices("optimizer.type"));
  y << YAML::Key << "scheduler" << YAML::Value << YAML::Flow << YAML::BeginMap;
  FlowEntries(y, {{"type", Raw("cosine")}, {"warmup_steps", Raw(std::min(20, a.max_steps / 10))}});
  y << YAML::EndMap;
  Trailing(y, config::TrainChoices("scheduler.type"));
  Entry(y, "max_grad_norm", Raw("1.0"), "gradient clipping; 0 = none");
  y << YAML::Key << "parallel" << YAML::Value << YAML::BeginMap;
  Entry(y, "mode", Raw(a.parallel_mode), config::TrainChoices("parallel.mode"));
  if (a.parallel_mode == "ddp" && a.local_sgd_steps == 0)
    Entry(y, "bucket_cap_mb", Raw(config::TrainDefault("parallel.bucket_cap_mb")),
          "gradient bucket size");
  if (a.parallel_mode == "zero")
    Entry(y, "zero_stage", Raw(a.zero_stage), config::TrainDoc("parallel.zero_stage"));
  if (dp)
    Entry(y, "replicas", Raw(config::TrainDefault("parallel.replicas")),
          config::TrainDoc("parallel.replicas"));
  if (a.tensor > 1) Entry(y, "tensor", Raw(a.tensor), config::TrainDoc("parallel.tensor"));
  if (a.parallel_mode == "pipeline") {
    Entry(y, "stages", Raw(a.stages), "processes per pipeline");
    Entry(y, "microbatches", Raw(a.microbatches), "per optimizer step");
    Entry(y, "schedule", Raw(config::TrainDefault("parallel.schedule")),
          config::TrainChoices("parallel.schedule"));
  }
  y << YAML::EndMap;
  Entry(y, "gradient_accumulation_steps", Raw(a.gradient_accumulation_steps),
        "micro-batches per optimizer step");
  if (a.local_sgd_steps > 0)
    Entry(y, "local_sgd_steps", Raw(a.local_sgd_steps), config::TrainDoc("local_sgd_steps"));
  for (const char* key : {"sync_each_batch", "checkpoint_every", "resume"})
    Entry(y, key, Raw(config::TrainDefault(key)), config::TrainDoc(key));
  y << YAML::EndMap << YAML::EndMap;
  return Finish(y);
}

int RunConfigCommand(const std::vector<std::string>& args) {
  Args parsed;
  std::string mode;
  CLI::App app{kUsage, "launch config"};
  app.add_option("mode", mode, "`default`: write a config for this machine without questions");
  app.add_option("--config_file,--config-file", parsed.config_file,
                 "where to write (default: $XDG_CONFIG_HOME/launch/default_config.yaml or "
                 "~/.config/launch/default_config.yaml, used by `launch` when no config is given)");
  app.add_flag("-f,--force", parsed.force, "`default` only: overwrite an existing file");
  app.formatter(config::HelpFormatter(30, /*cli11_usage=*/false));  // kUsage says it
  if (int rc = ParseSubcommandArgs(app, "config", args); rc >= 0) return rc;
  if (!mode.empty() && mode != "default") {
    std::cerr << "launch config: unknown argument '" << mode << "' (see launch config --help)\n";
    return kExitUsage;
  }
  parsed.is_default = mode == "default";
  if (parsed.force && !parsed.is_default) {
    std::cerr << "launch config: --force goes with `launch config default` (the wizard asks "
                 "before overwriting)\n";
    return kExitUsage;
  }
  std::string path = parsed.config_file.empty() ? DefaultConfigPath() : parsed.config_file;
  if (path.empty()) {
    std::cerr << "launch config: neither HOME nor XDG_CONFIG_HOME is set; give --config_file\n";
    return kExitUsage;
  }
  if (parsed.is_default) return RunDefault(parsed, path);
  return RunWizard(path, parsed.config_file.empty());
}

}  // namespace launch::launcher
