#include "config/train_cli.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <memory>

#include "base/strings.h"
#include "config/help_format.h"
#include "config/loader.h"
#include "config/scalars.h"
#include "config/train_keys.h"

namespace launch::config {
namespace {

std::string Dashed(std::string s) {
  std::replace(s.begin(), s.end(), '_', '-');
  return s;
}

// The distinct key paths, in table order.
std::vector<const TrainKey*> FlagKeys() {
  std::vector<const TrainKey*> keys;
  for (const TrainKey& k : TrainKeys()) {
    bool seen = false;
    for (const TrainKey* s : keys) seen |= s->path == k.path;
    if (!seen) keys.push_back(&k);
  }
  return keys;
}

}  // namespace

std::vector<std::string> TrainCommandLine::ProgramOptions() const {
  std::vector<std::string> out;
  if (dump_params) out.push_back("--dump_params");
  return out;
}

StatusOr<TrainCommandLine> ParseTrainCommandLine(const std::vector<std::string>& args) {
  TrainCommandLine cl;
  CLI::App app{
      "train: runs the `train:` section of a launch config on this rank (RANK, WORLD_SIZE,\n"
      "MASTER_ADDR, MASTER_PORT from the environment; start it with `launch CONFIG.yaml`).\n"
      "Precedence: flag > environment (LAUNCH_TRAIN_<KEY>, LAUNCH_MIXED_PRECISION) > YAML.",
      "train"};
  app.set_help_flag("-h,--help", "show this help and exit");
  app.formatter(HelpFormatter(40, /*cli11_usage=*/true));
  app.add_option("config", cl.config_path, "the YAML config (CONFIG.yaml)");
  app.add_option("--effective_config,--effective-config", cl.effective_config,
                 "a configuration launch resolved (no environment, no flags applied)");
  app.add_flag("--self_test,--self-test", cl.self_test,
               "the distributed self-check behind `launch test`");
  app.add_flag("--version", cl.version, "print the version and the LibTorch it uses, and exit");
  app.add_flag("--dump_params,--dump-params", cl.dump_params,
               "also write every parameter as raw float32 (output_dir/params_rank<R>.bin)");
  const std::vector<const TrainKey*> keys = FlagKeys();
  std::vector<std::unique_ptr<std::string>> values;
  std::vector<CLI::Option*> options;
  for (const TrainKey* k : keys) {
    values.push_back(std::make_unique<std::string>());
    std::string names = "--" + k->path;
    if (Dashed(k->path) != k->path) names += ",--" + Dashed(k->path);
    std::string help = k->doc;
    if (!k->choices.empty()) help += " (" + Join(k->choices, " | ") + ")";
    CLI::Option* opt = app.add_option(names, *values.back(), help);
    opt->group("Configuration (train: keys)")->type_name(k->is_list ? "LIST" : "VALUE");
    opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    options.push_back(opt);
  }
  std::vector<std::string> reversed(args.rbegin(), args.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    cl.help = true;
    cl.help_text = app.help();
    return cl;
  } catch (const CLI::ParseError& e) {
    std::string msg = e.what();
    for (const std::string& a : args) {
      if (!StartsWith(a, "--")) continue;
      std::string name =
          a.substr(2, a.find('=') == std::string::npos ? std::string::npos : a.find('=') - 2);
      if (app.get_option_no_throw("--" + name) != nullptr) continue;
      std::vector<std::string> known = {"effective_config", "self_test", "dump_params"};
      for (const TrainKey* k : keys) known.push_back(k->path);
      msg = "unknown flag '" + a + "'" + NearMiss(name, known) + "; see train --help";
      break;
    }
    return Status::InvalidArgument(msg);
  }
  for (size_t i = 0; i < keys.size(); ++i)
    if (options[i]->count() > 0)
      cl.settings.push_back({keys[i]->path, *values[i], "--" + keys[i]->path});
  return cl;
}

Status ApplyTrainFlags(const TrainCommandLine& cl, const std::string& suffix, LaunchConfig* cfg) {
  for (const TrainCommandLine::Setting& s : cl.settings) {
    const TrainKey* key = FindTrainKey(s.path, cfg->train);
    Origin origin{Origin::Kind::kFlag, s.flag + suffix};
    LAUNCH_RETURN_IF_ERROR(ApplyTrainSetting(
        s.path, TrainValue::FromText(s.value, key && key->is_list), origin, s.flag, cfg));
  }
  return Status::Ok();
}

StatusOr<LaunchConfig> ResolveTrainConfig(const TrainCommandLine& cl,
                                          const std::map<std::string, std::string>& env) {
  LaunchConfig cfg;
  if (!cl.effective_config.empty()) {
    if (!cl.config_path.empty() || !cl.settings.empty())
      return Status::InvalidArgument(
          "--effective_config is a resolved configuration: give no CONFIG.yaml and no "
          "configuration flags with it");
    LAUNCH_RETURN_IF_ERROR(LoadYamlFile(cl.effective_config, &cfg));
    cfg.effective = true;
  } else {
    if (cl.config_path.empty())
      return Status::InvalidArgument("no CONFIG.yaml given; see train --help");
    LAUNCH_RETURN_IF_ERROR(LoadYamlFile(cl.config_path, &cfg));
    LAUNCH_RETURN_IF_ERROR(ApplyEnvironment(env, &cfg));
    LAUNCH_RETURN_IF_ERROR(ApplyTrainFlags(cl, "", &cfg));
  }
  if (!cfg.train.present)
    return Status::InvalidConfig(cfg.config_path +
                                 ": no `train:` section (see configs/quickstart.yaml)");
  LAUNCH_RETURN_IF_ERROR(ValidateTrain(&cfg));
  return cfg;
}

}  // namespace launch::config
