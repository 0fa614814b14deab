#pragma once

// TensorBoard event files: the scalars a run logs (loss, learning rate, throughput, evaluation),
// read by `tensorboard --logdir DIR` and by PyTorch's and TensorFlow's readers.
//
// A file is a sequence of records, each one serialized Event (tensorboard_event.proto, written
// with Debian's protobuf library) framed as TensorBoard reads it: the length (8 bytes, little
// endian), the masked CRC-32C of those 8 bytes, the Event's bytes, and their masked CRC-32C. The
// first record names the format ("brain.Event:2"); each AddScalars call adds one Event.
//
//   auto writer = EventFileWriter::Create("runs/x/tensorboard");   // makes the folder
//   writer->AddScalars(step, {{"train/loss", 0.52}, {"train/lr", 1e-3}});
//
// Thread-safety: none (one writer per process; the accelerator's main process).

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"

namespace launch::trainer {

class EventFileWriter {
 public:
  // Creates `dir` (and its parents) and a new file in it named as TensorBoard looks for them:
  // events.out.tfevents.<seconds since the epoch>.<host name>.<pid>. IoError naming the path.
  static StatusOr<std::unique_ptr<EventFileWriter>> Create(const std::string& dir);
  ~EventFileWriter();
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  // One Event at `step`, now, holding `values` (tag, value) as float scalars; written through
  // to the file (a reader sees it at once, a kill loses none). IoError naming the file.
  Status AddScalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);

  const std::string& path() const { return path_; }

 private:
  EventFileWriter(std::string path, std::FILE* file) : path_(std::move(path)), file_(file) {}
  Status WriteRecord(const std::string& data);

  std::string path_;
  std::FILE* file_;
};

// CRC-32C (Castagnoli) of `data`, and the masked form the record framing stores:
// ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t Crc32c(std::string_view data);
uint32_t MaskedCrc32c(std::string_view data);

}  // namespace launch::trainer
