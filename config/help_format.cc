#include "config/help_format.h"

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "base/strings.h"

namespace launch::config {
namespace {

class WrappingFormatter : public CLI::Formatter {
 public:
  WrappingFormatter(size_t name_width, bool cli11_usage) : cli11_usage_(cli11_usage) {
    column_width(name_width);
  }

  std::string make_usage(const CLI::App* app, std::string name) const override {
    return cli11_usage_ ? CLI::Formatter::make_usage(app, std::move(name)) : std::string();
  }

  std::string make_option(const CLI::Option* opt, bool is_positional) const override {
    const size_t width = get_column_width();
    std::string out = "  " + make_option_name(opt, is_positional) + make_option_opts(opt);
    // Names too long for one line (a deep train: key and its dashed spelling): one per line.
    if (out.size() > kHelpWidth) {
      const std::vector<std::string> names = Split(make_option_name(opt, is_positional), ',');
      out = "  " + Join(names, ",\n  ") + make_option_opts(opt);
    }
    const std::string desc = make_option_desc(opt);
    if (desc.empty()) return out + "\n";
    const std::string indent(width, ' ');
    out += out.size() >= width ? "\n" + indent : std::string(width - out.size(), ' ');
    const std::vector<std::string> lines =
        WrapText(desc, kHelpWidth > width + 20 ? kHelpWidth - width : 20);
    out += Join(lines, "\n" + indent);
    return out + "\n";
  }

 private:
  bool cli11_usage_;
};

}  // namespace

std::shared_ptr<CLI::Formatter> HelpFormatter(size_t name_width, bool cli11_usage) {
  return std::make_shared<WrappingFormatter>(name_width, cli11_usage);
}

}  // namespace launch::config
