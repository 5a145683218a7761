//! TensorBoard event files, written natively.
//!
//! - `proto`: the `Event`/`Summary` protobuf messages (tensorboard's field numbers);
//! - `tfrecord`: TFRecord framing with masked CRC32C;
//! - `image`: image checks and PNG encoding;
//! - `encode`: the events of a batch of points, as torch's `SummaryWriter` writes them
//!   (detectron2's `TensorboardXWriter` holds one);
//! - `file`: the lazily created event file and the writer thread's sink.
//!
//! This folder sits above the generic writer thread (`crate::writer`): the thread hands it
//! `crate::record` points and knows nothing of the format.

mod encode;
mod file;
mod image;
pub mod proto;
mod tfrecord;

#[cfg(test)]
mod tests;

pub use encode::{
    encode_events, file_version_record, histogram_buckets, purge_record, FILE_VERSION,
};
pub use file::{event_file_name, EventFile, EventSink};
pub use image::{check_chw, check_image_shape, encode_png};
pub use tfrecord::{append_record, masked_crc32c};
