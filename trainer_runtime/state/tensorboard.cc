#include "trainer_runtime/state/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "base/files.h"
#include "trainer_runtime/state/tensorboard_event.pb.h"

namespace launch::trainer {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The reflected CRC-32C table (polynomial 0x82F63B78), built once.
const std::array<uint32_t, 256>& Crc32cTable() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

}  // namespace

uint32_t Crc32c(std::string_view data) {
  const auto& table = Crc32cTable();
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : data) crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t MaskedCrc32c(std::string_view data) {
  const uint32_t crc = Crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

StatusOr<std::unique_ptr<EventFileWriter>> EventFileWriter::Create(const std::string& dir) {
  LAUNCH_RETURN_IF_ERROR(MakeDirs(dir));
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  const std::string path = dir + "/events.out.tfevents." +
                           std::to_string(static_cast<long long>(Now())) + "." + host + "." +
                           std::to_string(::getpid());
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) return Status::FromErrno("creating " + path, errno);
  std::unique_ptr<EventFileWriter> writer(new EventFileWriter(path, file));
  tensorboard::Event event;
  event.set_wall_time(Now());
  event.set_file_version("brain.Event:2");
  LAUNCH_RETURN_IF_ERROR(writer->WriteRecord(event.SerializeAsString()));
  return writer;
}

EventFileWriter::~EventFileWriter() { std::fclose(file_); }

Status EventFileWriter::AddScalars(int64_t step,
                                   const std::vector<std::pair<std::string, double>>& values) {
  tensorboard::Event event;
  event.set_wall_time(Now());
  event.set_step(step);
  tensorboard::Summary* summary = event.mutable_summary();
  for (const auto& [tag, value] : values) {
    tensorboard::SummaryValue* v = summary->add_value();
    v->set_tag(tag);
    v->set_simple_value(static_cast<float>(value));
  }
  return WriteRecord(event.SerializeAsString());
}

Status EventFileWriter::WriteRecord(const std::string& data) {
  std::string record;
  record.reserve(data.size() + 16);
  char length[8];
  uint64_t n = data.size();
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((n >> (8 * i)) & 0xFF);  // LE
  auto put32 = [&record](uint32_t v) {
    for (int i = 0; i < 4; ++i) record.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  };
  record.append(length, 8);
  put32(MaskedCrc32c(std::string_view(length, 8)));
  record.append(data);
  put32(MaskedCrc32c(data));
  errno = 0;
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size() ||
      std::fflush(file_) != 0)
    return Status::FromErrno("writing " + path_, errno != 0 ? errno : EIO);
  return Status::Ok();
}

}  // namespace launch::trainer
