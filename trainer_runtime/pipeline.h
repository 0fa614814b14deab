#pragma once

// Pipeline-parallel training (`train.parallel.mode: pipeline`), optionally combined with data
// parallelism (2-D: PP x DP). LibTorch-free header; trainer.cc dispatches here.
//
// Layout: with P = parallel.stages and world size W = P x D, global rank r runs stage r % P of
// pipeline replica r / P (the stages of one pipeline are adjacent ranks, so on one node they
// talk over loopback). Stage s of every replica forms its own Gloo group (a PrefixStore view of
// the job's TCPStore) that all-reduces the stage's gradients once per optimizer step.
//
// Model: the built-in MLP's Linear layers, or the transformer's blocks (the embeddings go with
// the first block, the final LayerNorm and head with the last), are split into P consecutive
// stages by parallel.partition or balanced by parameter count; or model.torchscript is a list
// of P TorchScript modules, one per stage. Every rank first builds the whole model from the
// seed and keeps only its stage's layers, so the initial weights equal a single process's.
//
// One optimizer step = gradient_accumulation_steps pipeline flushes; each flush splits the
// replica's batch (batch_size rows) into parallel.microbatches near-equal micro-batches and
// runs the schedule (pipeline_schedule.h): activations go forward and their gradients back with
// Gloo send/recv (a small shape header precedes each activation). The last stage computes the
// loss per micro-batch, weighted by rows / batch_size / accumulation steps, so the gradients
// equal one process training on the whole batch. Gradient clipping uses the norm over all
// stages.
//
// Each stage owns its optimizer and writes its checkpoint shard to
// <output_dir>/checkpoints/pipeline/step<N>/stage<s>.pt (replica 0 of each stage); after every
// shard is written, rank 0 publishes N in checkpoints/pipeline/latest. A restart reads
// `latest`, so all stages resume from the same step even if the job died mid-checkpoint.
//
// Outputs: metrics.jsonl and final.json are written by the last stage of replica 0 (it has the
// loss). final.json adds a "pipeline" object: per-stage peak live micro-batches (counted by the
// executor), idle fractions (1 - compute time / schedule time, measured) next to the
// theoretical bubble, peak RSS, and per-stage parameter checksums. --dump_params writes each
// rank's stage parameters to params_rank<R>.bin (concatenate stages 0..P-1 for the model).

#include "base/status.h"
#include "config/train_config.h"
#include "trainer_runtime/trainer.h"

namespace launch::trainer {

// Trains to completion; same error contract as RunTrainer. InvalidConfig (before anything
// trains) when the world size is not a multiple of stages, there are more stages than layers,
// the partition does not cover the model, batch_size < microbatches, or 1F1B has fewer
// micro-batches than stages.
// REQUIRES: train.parallel.mode == kPipeline.
Status RunPipelineTrainer(const config::TrainConfig& train, const TrainerOptions& options);

}  // namespace launch::trainer
