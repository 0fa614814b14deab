#pragma once

// --help laid out for a 100-column terminal: CLI11's own layout leaves each description on one
// line, however long (244 columns for `launch --help`'s longest).

#include <cstddef>
#include <memory>

namespace CLI {
class Formatter;
}  // namespace CLI

namespace launch::config {

inline constexpr size_t kHelpWidth = 100;

// A CLI11 formatter: flag names in a column `name_width` wide, their descriptions wrapped at
// spaces to end by column kHelpWidth (a name wider than its column puts its description on the
// next line). Without `cli11_usage`, no "Usage:" line of CLI11's own: for programs whose
// description starts with their usage lines.
std::shared_ptr<CLI::Formatter> HelpFormatter(size_t name_width, bool cli11_usage);

}  // namespace launch::config
