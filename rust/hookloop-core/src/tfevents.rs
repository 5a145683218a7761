//! TensorBoard event files, written natively: the `Event`/`Summary` protobuf messages,
//! TFRecord framing, PNG image summaries and a lazily created event file.
//!
//! The messages are hand-written prost structs mirroring tensorboard's
//! `tensorboard/compat/proto/{event,summary,histogram,tensor,tensor_shape}.proto`. Only the
//! fields hookloop writes are declared; the field numbers are tensorboard's, so any reader
//! decodes them. Decoding a file written by someone else ignores the fields not declared here.
//!
//! What is written for each value is what torch's `SummaryWriter` writes for it (detectron2's
//! `TensorboardXWriter` holds one): legacy `simple_value` scalars, PNG images with a single
//! channel repeated as RGB, histograms with TensorBoard's bucket layout, and text as a tensor
//! with the text plugin's metadata.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::PathBuf;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use prost::Message;

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, ImageError, Result};
use crate::writer::{Durability, FsyncPolicy, Payload, Sink};

/// The `file_version` of every event file TensorBoard reads today.
pub const FILE_VERSION: &str = "brain.Event:2";

/// One record of an event file: a timestamp, a step and what happened.
///
/// Mirrors `tensorboard.Event`; fields 4 and 6–10 (graphs, logs, metadata) are not declared.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    /// Seconds since the Unix epoch.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// Global step (detectron2's iteration).
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// The payload: the file version (first record only), a summary, or a session log.
    #[prost(oneof = "event::What", tags = "3, 5, 7")]
    pub what: Option<event::What>,
}

/// Mirrors `tensorboard.SessionLog`: hookloop writes `START` only, TensorBoard's purge marker
/// (`SummaryWriter(purge_step=N)`): a reader drops the events of steps >= N written before it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SessionLog {
    /// `SessionStatus`: 1 is `START`.
    #[prost(int32, tag = "1")]
    pub status: i32,
}

/// `SessionLog.SessionStatus.START`.
pub const SESSION_START: i32 = 1;

/// The purge marker at `step`: what a resumed run writes so that TensorBoard discards the
/// stale events a killed run left at steps >= `step`.
pub fn purge_record(wall_time: f64, step: i64) -> Vec<u8> {
    let event = Event {
        wall_time,
        step,
        what: Some(event::What::SessionLog(SessionLog {
            status: SESSION_START,
        })),
    };
    let mut out = Vec::new();
    append_event(&mut out, &event);
    out
}

/// Nested types of [`Event`].
pub mod event {
    /// The payload of an [`Event`](super::Event).
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum What {
        /// Set on the first record of a file only; always [`FILE_VERSION`](super::FILE_VERSION).
        #[prost(string, tag = "3")]
        FileVersion(String),
        /// A set of tagged values.
        #[prost(message, tag = "5")]
        Summary(super::Summary),
        /// A session event: the purge marker.
        #[prost(message, tag = "7")]
        SessionLog(super::SessionLog),
    }
}

/// A set of tagged values; hookloop writes exactly one per [`Event`].
///
/// Mirrors `tensorboard.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    /// The values, each with its own tag.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<summary::Value>,
}

/// Nested types of [`Summary`].
pub mod summary {
    /// One tagged value. Mirrors `tensorboard.Summary.Value`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Value {
        /// The series name, e.g. `"total_loss"` or `"lr"`.
        #[prost(string, tag = "1")]
        pub tag: String,
        /// Plugin metadata; legacy scalar, image and histogram values need none, tensors name
        /// their plugin here.
        #[prost(message, optional, tag = "9")]
        pub metadata: Option<super::SummaryMetadata>,
        /// The value itself.
        #[prost(oneof = "value::Value", tags = "2, 4, 5, 8")]
        pub value: Option<value::Value>,
    }

    /// An encoded image. Mirrors `tensorboard.Summary.Image`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Image {
        /// Height in pixels.
        #[prost(int32, tag = "1")]
        pub height: i32,
        /// Width in pixels.
        #[prost(int32, tag = "2")]
        pub width: i32,
        /// 1 grey, 2 grey + alpha, 3 RGB, 4 RGBA (as `SummaryWriter`, hookloop writes a grey
        /// image as RGB: 2, 3 or 4).
        #[prost(int32, tag = "3")]
        pub colorspace: i32,
        /// The PNG file bytes.
        #[prost(bytes = "vec", tag = "4")]
        pub encoded_image_string: Vec<u8>,
    }

    /// Nested types of [`Value`].
    pub mod value {
        /// The payload of a [`Value`](super::Value).
        #[derive(Clone, PartialEq, prost::Oneof)]
        pub enum Value {
            /// A scalar; TensorBoard stores scalars as float32.
            #[prost(float, tag = "2")]
            SimpleValue(f32),
            /// An encoded image.
            #[prost(message, tag = "4")]
            Image(super::Image),
            /// A histogram.
            #[prost(message, tag = "5")]
            Histo(super::super::HistogramProto),
            /// A tensor, read by the plugin its metadata names (text, new-style scalars).
            #[prost(message, tag = "8")]
            Tensor(super::super::TensorProto),
        }
    }
}

/// Which plugin owns a series. Mirrors `tensorboard.SummaryMetadata`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryMetadata {
    /// The owning plugin and its data.
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<summary_metadata::PluginData>,
    /// Display name in TensorBoard.
    #[prost(string, tag = "2")]
    pub display_name: String,
    /// Markdown description of the series.
    #[prost(string, tag = "3")]
    pub summary_description: String,
    /// `tensorboard.DataClass` as its integer value (0 unknown, 1 scalar, 2 tensor, 3 blob).
    #[prost(int32, tag = "4")]
    pub data_class: i32,
}

/// Nested types of [`SummaryMetadata`].
pub mod summary_metadata {
    /// A plugin name and its opaque content. Mirrors `SummaryMetadata.PluginData`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PluginData {
        /// e.g. `"scalars"`, `"images"`, `"histograms"`.
        #[prost(string, tag = "1")]
        pub plugin_name: String,
        /// Plugin-specific bytes, usually a serialized protobuf.
        #[prost(bytes = "vec", tag = "2")]
        pub content: Vec<u8>,
    }
}

/// `tensorboard.DataType.DT_FLOAT`.
pub const DT_FLOAT: i32 = 1;
/// `tensorboard.DataType.DT_DOUBLE`.
pub const DT_DOUBLE: i32 = 2;
/// `tensorboard.DataType.DT_STRING`.
pub const DT_STRING: i32 = 7;

/// A tensor's values. Mirrors `tensorboard.TensorProto`; only the fields for float, double
/// and string tensors are declared.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorProto {
    /// `tensorboard.DataType` as its integer value ([`DT_FLOAT`], [`DT_DOUBLE`],
    /// [`DT_STRING`]).
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    /// The shape; absent for a scalar.
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShapeProto>,
    /// `DT_FLOAT` values.
    #[prost(float, repeated, tag = "5")]
    pub float_val: Vec<f32>,
    /// `DT_DOUBLE` values.
    #[prost(double, repeated, tag = "6")]
    pub double_val: Vec<f64>,
    /// `DT_STRING` values, as bytes.
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

/// A tensor's shape. Mirrors `tensorboard.TensorShapeProto`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorShapeProto {
    /// The dimensions, outermost first.
    #[prost(message, repeated, tag = "2")]
    pub dim: Vec<tensor_shape_proto::Dim>,
}

/// Nested types of [`TensorShapeProto`].
pub mod tensor_shape_proto {
    /// One dimension. Mirrors `TensorShapeProto.Dim`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Dim {
        /// Its size.
        #[prost(int64, tag = "1")]
        pub size: i64,
    }
}

/// A histogram as TensorBoard stores it. Mirrors `tensorboard.HistogramProto`.
///
/// Bucket `i` counts values in `(bucket_limit[i-1], bucket_limit[i]]`; bucket 0 starts at
/// `-f64::MAX`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HistogramProto {
    /// Smallest value.
    #[prost(double, tag = "1")]
    pub min: f64,
    /// Largest value.
    #[prost(double, tag = "2")]
    pub max: f64,
    /// Number of values.
    #[prost(double, tag = "3")]
    pub num: f64,
    /// Sum of the values.
    #[prost(double, tag = "4")]
    pub sum: f64,
    /// Sum of the squared values.
    #[prost(double, tag = "5")]
    pub sum_squares: f64,
    /// Right edges of the buckets (packed, as proto3 repeated scalars are).
    #[prost(double, repeated, tag = "6")]
    pub bucket_limit: Vec<f64>,
    /// Counts, parallel to `bucket_limit`.
    #[prost(double, repeated, tag = "7")]
    pub bucket: Vec<f64>,
}

/// A scalar for TensorBoard's scalar dashboard. Stored as float32, as TensorBoard does.
#[derive(Debug, Clone, PartialEq)]
pub struct ScalarPoint {
    /// Series name.
    pub tag: std::sync::Arc<str>,
    /// The value; rounded to `f32` when written.
    pub value: f64,
    /// Global step.
    pub step: i64,
}

/// An image for TensorBoard's image dashboard, written as PNG.
///
/// A grey image (1 channel) is written as RGB with the channel repeated, as `SummaryWriter`
/// writes it (its `convert_to_HWC`); 2 (grey + alpha), 3 (RGB) and 4 (RGBA) channels are
/// written as they are.
#[derive(Debug, Clone, PartialEq)]
pub struct ImagePoint {
    /// Series name.
    pub tag: String,
    /// Global step.
    pub step: i64,
    /// Height in pixels.
    pub height: u32,
    /// Width in pixels.
    pub width: u32,
    /// 1 (grey), 2 (grey + alpha), 3 (RGB) or 4 (RGBA).
    pub channels: u8,
    /// Row-major HWC uint8 pixels: `height * width * channels` bytes.
    pub pixels: Vec<u8>,
}

/// A histogram for TensorBoard's histogram dashboard; see [`HistogramProto`] for the buckets.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramPoint {
    /// Series name.
    pub tag: String,
    /// Global step.
    pub step: i64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
    /// Number of values.
    pub num: f64,
    /// Sum of the values.
    pub sum: f64,
    /// Sum of the squared values.
    pub sum_squares: f64,
    /// Right edges of the buckets.
    pub bucket_limits: Vec<f64>,
    /// Counts, parallel to `bucket_limits`.
    pub bucket_counts: Vec<f64>,
}

impl HistogramPoint {
    /// A histogram from `add_histogram_raw`'s parameters (`stats`: min, max, num, sum,
    /// sum_squares); the limits and counts must pair up.
    pub fn new(
        tag: String,
        step: i64,
        stats: [f64; 5],
        bucket_limits: Vec<f64>,
        bucket_counts: Vec<f64>,
    ) -> Result<HistogramPoint> {
        if bucket_limits.len() != bucket_counts.len() {
            return Err(Error::bad_value(
                format!("histogram '{tag}'"),
                format!(
                    "has {} bucket limits but {} bucket counts",
                    bucket_limits.len(),
                    bucket_counts.len()
                ),
            ));
        }
        let [min, max, num, sum, sum_squares] = stats;
        Ok(HistogramPoint {
            tag,
            step,
            min,
            max,
            num,
            sum,
            sum_squares,
            bucket_limits,
            bucket_counts,
        })
    }
}

/// TensorBoard's bucket layout of a histogram, as torch's `make_histogram` (behind
/// `SummaryWriter.add_histogram`) lays out `numpy.histogram`'s `counts` between `edges`:
/// returns `(bucket_limits, bucket_counts)`.
///
/// With `max_bins` below the number of bins, every `n / max_bins` consecutive bins are merged
/// (the last group may be shorter). Then only the bins from the first to the last non-empty
/// one are kept, each as its right edge and count, preceded by one empty bucket whose limit
/// is the first kept bin's left edge: TensorBoard stores right edges only, and that bucket
/// keeps the leftmost one. Errors (as reasons) for mismatched lengths, `max_bins` below 1,
/// and bins that hold no value.
pub fn histogram_buckets(
    edges: &[f64],
    counts: &[f64],
    max_bins: Option<i64>,
) -> std::result::Result<(Vec<f64>, Vec<f64>), String> {
    let n = counts.len();
    if n == 0 || edges.len() != n + 1 {
        return Err(format!(
            "needs one more bin edge than bin counts and at least one bin, got {} edges and {n} \
             counts",
            edges.len()
        ));
    }
    let max_bins = match max_bins {
        Some(m) if m < 1 => return Err(format!("max_bins must be a positive integer, got {m}")),
        // Beyond usize: more than any number of bins.
        Some(m) => Some(usize::try_from(m).unwrap_or(usize::MAX)),
        None => None,
    };
    let (limits, counts) = match max_bins {
        Some(m) if n > m => {
            let group = n / m; // 1 <= group < n
            let merged: Vec<f64> = counts.chunks(group).map(|c| c.iter().sum()).collect();
            let mut limits: Vec<f64> = edges[..n].iter().step_by(group).copied().collect();
            limits.push(edges[n]);
            (limits, merged)
        }
        _ => (edges.to_vec(), counts.to_vec()),
    };
    let (Some(first), Some(last)) = (
        counts.iter().position(|&c| c > 0.0),
        counts.iter().rposition(|&c| c > 0.0),
    ) else {
        return Err("has no value within its bins (the histogram is empty)".to_owned());
    };
    let end = last + 1;
    let (limits, counts) = if first > 0 {
        (
            limits[first..=end].to_vec(),
            counts[first - 1..end].to_vec(),
        )
    } else {
        let mut c = Vec::with_capacity(end + 1);
        c.push(0.0);
        c.extend_from_slice(&counts[..end]);
        (limits[..=end].to_vec(), c)
    };
    Ok((limits, counts))
}

/// A value written as a tensor with its plugin's metadata, as `SummaryWriter` writes text.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorPoint {
    /// Series name, as written (text gets `/text_summary` appended: see [`TensorPoint::text`]).
    pub tag: String,
    /// Global step.
    pub step: i64,
    /// The value.
    pub value: TensorValue,
}

/// The value of a [`TensorPoint`].
#[derive(Debug, Clone, PartialEq)]
pub enum TensorValue {
    /// `add_text`: a `DT_STRING` tensor of shape `[1]` for the text plugin.
    Text(String),
}

impl TensorPoint {
    /// `add_text(tag, text)`: stored under `tag + "/text_summary"`, as `SummaryWriter` does.
    pub fn text(tag: &str, step: i64, text: String) -> TensorPoint {
        TensorPoint {
            tag: format!("{tag}/text_summary"),
            step,
            value: TensorValue::Text(text),
        }
    }

    fn to_value(&self) -> summary::Value {
        let (plugin, tensor) = match &self.value {
            TensorValue::Text(text) => (
                "text",
                TensorProto {
                    dtype: DT_STRING,
                    tensor_shape: Some(TensorShapeProto {
                        dim: vec![tensor_shape_proto::Dim { size: 1 }],
                    }),
                    string_val: vec![text.as_bytes().to_vec()],
                    ..TensorProto::default()
                },
            ),
        };
        // The text plugin's content is `TextPluginData(version=0)`, which serializes to no
        // bytes.
        let metadata = SummaryMetadata {
            plugin_data: Some(summary_metadata::PluginData {
                plugin_name: plugin.to_owned(),
                content: Vec::new(),
            }),
            ..SummaryMetadata::default()
        };
        summary::Value {
            tag: self.tag.clone(),
            metadata: Some(metadata),
            value: Some(summary::value::Value::Tensor(tensor)),
        }
    }
}

/// TFRecord's masked CRC32C: the checksum rotated right by 15 bits plus a constant, so
/// that a CRC of data that itself holds CRCs stays well distributed.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Appends one TFRecord to `out`: u64 LE length, u32 LE masked CRC of those 8 bytes,
/// `data`, u32 LE masked CRC of `data`.
pub fn append_record(out: &mut Vec<u8>, data: &[u8]) {
    // usize is at most 64 bits on every target Rust supports, so this never truncates.
    let len = (data.len() as u64).to_le_bytes();
    out.reserve(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
}

fn append_event(out: &mut Vec<u8>, event: &Event) {
    append_record(out, &event.encode_to_vec());
}

fn summary_event(wall_time: f64, step: i64, value: summary::Value) -> Event {
    Event {
        wall_time,
        step,
        what: Some(event::What::Summary(Summary { value: vec![value] })),
    }
}

/// A value with no plugin metadata (legacy scalars, images, histograms).
fn plain_value(tag: &str, value: summary::value::Value) -> summary::Value {
    summary::Value {
        tag: tag.to_owned(),
        metadata: None,
        value: Some(value),
    }
}

/// Checks an image's shape; on success returns `(width, height)` as the `i32`s the
/// `Image` message holds.
///
/// The one image rule: the binding checks queued images with it, the encoder again.
pub fn check_image_shape(
    width: u64,
    height: u64,
    channels: u64,
    len: usize,
) -> std::result::Result<(i32, i32), ImageError> {
    if !(1..=4).contains(&channels) {
        return Err(ImageError::UnsupportedChannels { channels });
    }
    if width == 0 || height == 0 {
        return Err(ImageError::Empty { width, height });
    }
    let (Ok(w), Ok(h)) = (i32::try_from(width), i32::try_from(height)) else {
        return Err(ImageError::TooLarge { width, height });
    };
    // width * height * channels can reach 2^72; in u128 no overflow lets a wrong length pass.
    let expected = u128::from(width) * u128::from(height) * u128::from(channels);
    if u128::try_from(len).ok() != Some(expected) {
        return Err(ImageError::PixelCountMismatch {
            width,
            height,
            channels,
            len,
        });
    }
    Ok((w, h))
}

/// Checks the shape of an image as `put_image` takes it: `(C, H, W)` with C in 1..=4 and
/// H, W positive (the same rule `check_image_shape` applies to the pixels later).
pub fn check_chw(shape: &[i64]) -> std::result::Result<(u64, u64, u64), ImageError> {
    let [c, h, w] = shape else {
        return Err(ImageError::NotChw {
            shape: shape.to_vec(),
        });
    };
    let (c, h, w) = (
        u64::try_from(*c).unwrap_or(0),
        u64::try_from(*h).unwrap_or(0),
        u64::try_from(*w).unwrap_or(0),
    );
    if !(1..=4).contains(&c) {
        return Err(ImageError::UnsupportedChannels { channels: c });
    }
    if h == 0 || w == 0 {
        return Err(ImageError::Empty {
            width: w,
            height: h,
        });
    }
    if i32::try_from(w).is_err() || i32::try_from(h).is_err() {
        return Err(ImageError::TooLarge {
            width: w,
            height: h,
        });
    }
    Ok((c, h, w))
}

/// Encodes row-major HWC uint8 `pixels` (1 to 4 channels) as an 8-bit PNG file.
pub fn encode_png(
    width: u32,
    height: u32,
    channels: u8,
    pixels: &[u8],
) -> std::result::Result<Vec<u8>, ImageError> {
    check_image_shape(
        u64::from(width),
        u64::from(height),
        u64::from(channels),
        pixels.len(),
    )?;
    let color = match channels {
        1 => png::ColorType::Grayscale,
        2 => png::ColorType::GrayscaleAlpha,
        3 => png::ColorType::Rgb,
        _ => png::ColorType::Rgba,
    };
    let mut png_bytes = Vec::new();
    let mut encoder = png::Encoder::new(&mut png_bytes, width, height);
    encoder.set_color(color);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(pixels)?;
    // finish() writes IEND; without it the file is truncated.
    writer.finish()?;
    Ok(png_bytes)
}

fn image_event(wall_time: f64, image: &ImagePoint) -> std::result::Result<Event, ImageError> {
    let (width, height) = check_image_shape(
        u64::from(image.width),
        u64::from(image.height),
        u64::from(image.channels),
        image.pixels.len(),
    )?;
    // SummaryWriter repeats a single channel as RGB (`convert_to_HWC`); so does hookloop, so
    // that readers decode the same RGB PNG.
    let (channels, encoded) = if image.channels == 1 {
        let rgb: Vec<u8> = image.pixels.iter().flat_map(|&v| [v, v, v]).collect();
        (3, encode_png(image.width, image.height, 3, &rgb)?)
    } else {
        let encoded = encode_png(image.width, image.height, image.channels, &image.pixels)?;
        (image.channels, encoded)
    };
    let value = summary::value::Value::Image(summary::Image {
        height,
        width,
        colorspace: i32::from(channels),
        encoded_image_string: encoded,
    });
    Ok(summary_event(
        wall_time,
        image.step,
        plain_value(&image.tag, value),
    ))
}

/// Appends one framed record per point to `out` (one `Event` holding one `Summary`
/// value each): all scalars, then all images, then all histograms, then all tensors, each in
/// slice order.
///
/// On error `out` is left as it was: a bad image never leaves half a batch behind.
pub fn encode_events(
    out: &mut Vec<u8>,
    wall_time: f64,
    scalars: &[ScalarPoint],
    images: &[ImagePoint],
    histograms: &[HistogramPoint],
    tensors: &[TensorPoint],
) -> crate::Result<()> {
    // Images are the only fallible points; encode them before touching `out`.
    let image_events = images
        .iter()
        .map(|image| {
            image_event(wall_time, image).map_err(|e| Error::Image {
                tag: image.tag.clone(),
                step: Some(image.step),
                source: e,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    for s in scalars {
        let value = summary::value::Value::SimpleValue(s.value as f32);
        append_event(
            out,
            &summary_event(wall_time, s.step, plain_value(&s.tag, value)),
        );
    }
    for event in &image_events {
        append_event(out, event);
    }
    for h in histograms {
        let histo = HistogramProto {
            min: h.min,
            max: h.max,
            num: h.num,
            sum: h.sum,
            sum_squares: h.sum_squares,
            bucket_limit: h.bucket_limits.clone(),
            bucket: h.bucket_counts.clone(),
        };
        let value = summary::value::Value::Histo(histo);
        append_event(
            out,
            &summary_event(wall_time, h.step, plain_value(&h.tag, value)),
        );
    }
    for t in tensors {
        append_event(out, &summary_event(wall_time, t.step, t.to_value()));
    }
    Ok(())
}

/// The first record of every event file: `Event { wall_time, step: 0, file_version:
/// "brain.Event:2" }`, framed.
pub fn file_version_record(wall_time: f64) -> Vec<u8> {
    let mut out = Vec::new();
    append_event(
        &mut out,
        &Event {
            wall_time,
            step: 0,
            what: Some(event::What::FileVersion(FILE_VERSION.to_owned())),
        },
    );
    out
}

/// An event file name as torch.utils.tensorboard names it:
/// `events.out.tfevents.{time:010}.{hostname}.{pid}.{uid}`.
pub fn event_file_name(unix_time_secs: u64, hostname: &str, pid: u32, uid: u64) -> String {
    format!("events.out.tfevents.{unix_time_secs:010}.{hostname}.{pid}.{uid}")
}

/// Appends framed `records` in page-bounded write calls (see `append`), after checking the
/// file still exists at `path`; on disk full the whole records that fit stay.
fn append_records(file: &mut File, path: &std::path::Path, records: &[u8]) -> Result<()> {
    let start = crate::append::live_len(file, path)?;
    let ends = crate::append::record_ends(records);
    crate::append::append_units(file, records, &ends, start)
        .map_err(|f| f.into_error(path, "records"))
}

fn unix_time_now() -> f64 {
    // A clock before 1970 is a broken clock; 0.0 still gives a readable file.
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// One event file in a log directory, created on its first non-empty append.
///
/// Invariant: the file holds only whole records, and its first record is the
/// `file_version` event; a failed append is truncated away.
#[derive(Debug)]
pub struct EventFile {
    log_dir: PathBuf,
    file_name: String,
    file: Option<File>,
    // False until the file_version record is on disk; a failed first write retries it.
    header_written: bool,
    // The log directory's (device, inode) when it already existed at construction: if it is
    // gone by the first write (rmtree of the output directory), that is an error, not a new
    // directory holding only the event file.
    dir_id: Option<(u64, u64)>,
}

fn dir_id(dir: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(dir)
        .ok()
        .filter(|m| m.is_dir())
        .map(|m| (m.dev(), m.ino()))
}

impl EventFile {
    /// An event file at `log_dir/file_name`. Only looks at `log_dir`: the directory (if
    /// missing) and the file appear on the first [`append`](Self::append) with records.
    pub fn new(log_dir: PathBuf, file_name: String) -> EventFile {
        EventFile {
            dir_id: dir_id(&log_dir),
            log_dir,
            file_name,
            file: None,
            header_written: false,
        }
    }

    /// Appends already framed `records` (see [`encode_events`]).
    ///
    /// The first call with records creates the log directory and the file (failing if the
    /// file already exists) and writes the `file_version` record before them. `records`
    /// go to disk with one `write_all`; if it fails (disk full, quota) the file is
    /// truncated back to its previous length and the error returned. An empty `records`
    /// does nothing, so a writer that never logs leaves no file behind. Errors do not
    /// name the path; callers add [`path`](Self::path).
    pub fn append(&mut self, records: &[u8]) -> Result<()> {
        if records.is_empty() {
            return Ok(());
        }
        let path = self.path();
        let file = match &mut self.file {
            Some(file) => file,
            None => {
                let io = |e| Error::io(&path, e);
                if self.dir_id.is_some() && dir_id(&self.log_dir) != self.dir_id {
                    return Err(Error::Deleted {
                        path: self.log_dir.clone(),
                    });
                }
                std::fs::create_dir_all(&self.log_dir).map_err(io)?;
                let file = OpenOptions::new()
                    .append(true)
                    .create_new(true)
                    .open(&path)
                    .map_err(io)?;
                self.file.insert(file)
            }
        };
        if !self.header_written {
            append_records(file, &path, &file_version_record(unix_time_now()))?;
            self.header_written = true;
        }
        append_records(file, &path, records)
    }

    /// Checks that the file, once created, still exists at its path (before: that a log
    /// directory that existed at construction still does).
    pub fn verify(&self) -> Result<()> {
        match &self.file {
            Some(file) => crate::append::live_len(file, &self.path()).map(|_| ()),
            None if self.dir_id.is_some() && dir_id(&self.log_dir) != self.dir_id => {
                Err(Error::Deleted {
                    path: self.log_dir.clone(),
                })
            }
            None => Ok(()),
        }
    }

    /// Flushes the file; with `fsync`, also waits until its data reach the disk.
    /// Does nothing before the file exists.
    pub fn flush(&mut self, fsync: bool) -> io::Result<()> {
        if let Some(file) = &mut self.file {
            file.flush()?;
            if fsync {
                file.sync_data()?;
            }
        }
        Ok(())
    }

    /// `log_dir/file_name`, whether or not the file exists yet.
    pub fn path(&self) -> PathBuf {
        self.log_dir.join(&self.file_name)
    }

    /// Whether the file has been created on disk.
    pub fn is_created(&self) -> bool {
        self.file.is_some()
    }
}

// A failed unwrap in a test is the assertion. `allow`, not `expect`: `expect` would turn
// into an error if the workspace later sets clippy's `allow-unwrap-in-tests`.
/// A TensorBoard event file, created at its first non-empty write.
pub struct EventSink {
    file: EventFile,
    fsync: Durability,
    buf: Vec<u8>,
}

impl EventSink {
    /// An event file named like torch's SummaryWriter's in `log_dir`; no I/O yet.
    pub fn new(
        log_dir: PathBuf,
        hostname: &str,
        filename_suffix: &str,
        fsync: FsyncPolicy,
    ) -> EventSink {
        static UID: AtomicU64 = AtomicU64::new(0);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let uid = UID.fetch_add(1, Ordering::Relaxed);
        let name = crate::tfevents::event_file_name(now, hostname, std::process::id(), uid)
            + filename_suffix;
        EventSink {
            file: EventFile::new(log_dir, name),
            fsync: Durability::new(fsync),
            buf: Vec::new(),
        }
    }

    /// The file's path (it may not exist yet).
    pub fn path(&self) -> PathBuf {
        self.file.path()
    }
}

impl EventSink {
    fn write_pending(&mut self) -> Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        // EventFile::append keeps the whole records that fit and cuts a torn one.
        let result = self.file.append(&self.buf);
        self.buf.clear();
        result
    }
}

impl Sink for EventSink {
    fn write(&mut self, payload: Payload) -> Result<()> {
        let Payload::Events {
            wall_time,
            scalars,
            images,
            histograms,
            tensors,
        } = payload
        else {
            return Ok(());
        };
        // On a bad image encode_events leaves the buffer as it was.
        encode_events(
            &mut self.buf,
            wall_time,
            &scalars,
            &images,
            &histograms,
            &tensors,
        )
    }

    fn sync(&mut self) -> Result<()> {
        self.write_pending()?;
        let now = Instant::now();
        let fsync = self.fsync.after_batch(now);
        self.file
            .flush(fsync)
            .map_err(|e| Error::io(self.file.path(), e))?;
        if fsync {
            self.fsync.synced(now);
        }
        Ok(())
    }

    fn tick(&mut self, pause: bool) -> Result<()> {
        let now = Instant::now();
        if self.fsync.due(now, pause) {
            self.file
                .flush(true)
                .map_err(|e| Error::io(self.file.path(), e))?;
            self.fsync.synced(now);
        }
        Ok(())
    }

    fn purge(&mut self, wall_time: f64, from: f64) -> Result<u64> {
        self.buf.extend(purge_record(wall_time, from as i64));
        self.write_pending()?;
        Ok(0)
    }

    fn verify(&mut self) -> Result<()> {
        self.file.verify()
    }

    fn close(&mut self) -> Result<()> {
        self.write_pending()?;
        self.file.verify()?;
        self.file
            .flush(self.fsync.at_close())
            .map_err(|e| Error::io(self.file.path(), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufReader, Cursor};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Splits framed bytes into record payloads, checking both CRCs of every record.
    fn read_records(mut bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut records = Vec::new();
        while !bytes.is_empty() {
            assert!(bytes.len() >= 16, "truncated record header");
            let len_bytes: [u8; 8] = bytes[..8].try_into().unwrap();
            let len_crc = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
            assert_eq!(len_crc, masked_crc32c(&len_bytes), "length CRC");
            let len = usize::try_from(u64::from_le_bytes(len_bytes)).unwrap();
            assert!(bytes.len() >= 16 + len, "truncated record data");
            let data = &bytes[12..12 + len];
            let data_crc = u32::from_le_bytes(bytes[12 + len..16 + len].try_into().unwrap());
            assert_eq!(data_crc, masked_crc32c(data), "data CRC");
            records.push(data.to_vec());
            bytes = &bytes[16 + len..];
        }
        records
    }

    fn decode_events(bytes: &[u8]) -> Vec<Event> {
        read_records(bytes)
            .iter()
            .map(|r| Event::decode(r.as_slice()).unwrap())
            .collect()
    }

    /// The single summary value of an event.
    fn only_value(event: &Event) -> &summary::Value {
        match &event.what {
            Some(event::What::Summary(s)) => {
                assert_eq!(s.value.len(), 1);
                &s.value[0]
            }
            other => panic!("expected a summary, got {other:?}"),
        }
    }

    fn decode_png(bytes: &[u8]) -> (png::OutputInfo, Vec<u8>) {
        let decoder = png::Decoder::new(BufReader::new(Cursor::new(bytes)));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        buf.truncate(info.buffer_size());
        (info, buf)
    }

    fn gradient(width: u32, height: u32, channels: u8) -> Vec<u8> {
        let n = width as usize * height as usize * channels as usize;
        (0..n).map(|i| (i * 7 % 256) as u8).collect()
    }

    /// A fresh directory under the system temp dir, unique per test and process.
    fn scratch_dir(name: &str) -> PathBuf {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "hookloop-tfevents-{}-{}-{}",
            std::process::id(),
            name,
            n
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn crc32c_test_vectors() {
        // RFC 3720 (iSCSI) B.4 vectors and the common check value.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c::crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
        let ascending: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c::crc32c(&ascending), 0x46DD_794E);
    }

    #[test]
    fn masked_crc_of_known_values() {
        // Computed independently (bitwise CRC32C in Python, then the TFRecord mask).
        assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
        assert_eq!(masked_crc32c(b""), 0xA282_EAD8);
    }

    #[test]
    fn framed_record_exact_bytes() {
        let mut out = vec![0xEE]; // appending must keep what is already there
        append_record(&mut out, b"abc");
        let expected: [u8; 20] = [
            0xEE, // pre-existing byte
            0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // length 3, u64 LE
            0xb0, 0x99, 0x49, 0x0e, // masked crc of the length bytes
            0x61, 0x62, 0x63, // "abc"
            0x6e, 0x57, 0xf1, 0x21, // masked crc of "abc"
        ];
        assert_eq!(out, expected);
    }

    #[test]
    fn file_version_event_exact_bytes() {
        let records = read_records(&file_version_record(1.5));
        assert_eq!(records.len(), 1);
        let mut expected = vec![0x09]; // field 1, fixed64
        expected.extend_from_slice(&1.5f64.to_le_bytes());
        // step 0 is the proto3 default and is omitted
        expected.extend_from_slice(&[0x1a, 13]); // field 3, length-delimited
        expected.extend_from_slice(b"brain.Event:2");
        assert_eq!(records[0], expected);
    }

    #[test]
    fn scalar_event_exact_bytes() {
        let mut out = Vec::new();
        let scalar = ScalarPoint {
            tag: "a".into(),
            value: 2.0,
            step: 7,
        };
        encode_events(&mut out, 1.5, &[scalar], &[], &[], &[]).unwrap();
        let mut expected = vec![0x09];
        expected.extend_from_slice(&1.5f64.to_le_bytes());
        expected.extend_from_slice(&[
            0x10, 0x07, // field 2 (step), varint 7
            0x2a, 10, // field 5 (summary), 10 bytes
            0x0a, 8, // Summary field 1 (value), 8 bytes
            0x0a, 1, b'a', // Value field 1 (tag) "a"
            0x15, 0x00, 0x00, 0x00, 0x40, // Value field 2 (simple_value), f32 2.0
        ]);
        assert_eq!(read_records(&out), vec![expected]);
    }

    #[test]
    fn image_and_histogram_field_numbers() {
        let image = summary::Value {
            tag: String::new(),
            metadata: None,
            value: Some(summary::value::Value::Image(summary::Image {
                height: 1,
                width: 2,
                colorspace: 3,
                encoded_image_string: vec![0xAB],
            })),
        };
        assert_eq!(
            image.encode_to_vec(),
            [0x22, 9, 0x08, 1, 0x10, 2, 0x18, 3, 0x22, 1, 0xAB]
        );
        let histo = HistogramProto {
            min: 0.0,
            max: 0.0,
            num: 0.0,
            sum: 0.0,
            sum_squares: 0.0,
            bucket_limit: vec![1.0],
            bucket: vec![2.0],
        };
        let mut expected = vec![0x32, 8]; // field 6, packed
        expected.extend_from_slice(&1.0f64.to_le_bytes());
        expected.extend_from_slice(&[0x3a, 8]); // field 7, packed
        expected.extend_from_slice(&2.0f64.to_le_bytes());
        assert_eq!(histo.encode_to_vec(), expected);
        let value = summary::Value {
            tag: String::new(),
            metadata: None,
            value: Some(summary::value::Value::Histo(histo)),
        };
        assert_eq!(value.encode_to_vec()[..2], [0x2a, 20]); // Value field 5
    }

    #[test]
    fn encode_events_round_trip() {
        let scalars = vec![
            ScalarPoint {
                tag: "total_loss".into(),
                value: 0.125,
                step: 19,
            },
            ScalarPoint {
                tag: "lr".into(),
                value: 0.1,
                step: 19,
            },
        ];
        let images = vec![ImagePoint {
            tag: "vis".into(),
            step: 20,
            height: 3,
            width: 5,
            channels: 3,
            pixels: gradient(5, 3, 3),
        }];
        let histograms = vec![HistogramPoint {
            tag: "weights".into(),
            step: 21,
            min: -1.0,
            max: 2.0,
            num: 4.0,
            sum: 3.0,
            sum_squares: 7.0,
            bucket_limits: vec![0.0, 1.0, 2.0],
            bucket_counts: vec![1.0, 2.0, 1.0],
        }];
        let mut out = Vec::new();
        encode_events(&mut out, 1234.5, &scalars, &images, &histograms, &[]).unwrap();
        let events = decode_events(&out);
        assert_eq!(events.len(), 4);
        assert!(events.iter().all(|e| e.wall_time == 1234.5));

        for (event, scalar) in events[..2].iter().zip(&scalars) {
            assert_eq!(event.step, scalar.step);
            let value = only_value(event);
            assert_eq!(value.tag, &*scalar.tag);
            assert_eq!(
                value.value,
                Some(summary::value::Value::SimpleValue(scalar.value as f32))
            );
        }

        assert_eq!(events[2].step, 20);
        let value = only_value(&events[2]);
        assert_eq!(value.tag, "vis");
        let Some(summary::value::Value::Image(image)) = &value.value else {
            panic!("expected an image, got {:?}", value.value);
        };
        assert_eq!((image.height, image.width, image.colorspace), (3, 5, 3));
        let (info, pixels) = decode_png(&image.encoded_image_string);
        assert_eq!((info.width, info.height), (5, 3));
        assert_eq!(pixels, images[0].pixels);

        assert_eq!(events[3].step, 21);
        let value = only_value(&events[3]);
        assert_eq!(value.tag, "weights");
        let Some(summary::value::Value::Histo(h)) = &value.value else {
            panic!("expected a histogram, got {:?}", value.value);
        };
        let hp = &histograms[0];
        assert_eq!(
            (h.min, h.max, h.num, h.sum, h.sum_squares),
            (hp.min, hp.max, hp.num, hp.sum, hp.sum_squares)
        );
        assert_eq!(h.bucket_limit, hp.bucket_limits);
        assert_eq!(h.bucket, hp.bucket_counts);
    }

    #[test]
    fn png_round_trip_grey_rgb_rgba() {
        for (channels, color) in [
            (1, png::ColorType::Grayscale),
            (3, png::ColorType::Rgb),
            (4, png::ColorType::Rgba),
        ] {
            let pixels = gradient(7, 4, channels);
            let bytes = encode_png(7, 4, channels, &pixels).unwrap();
            let (info, decoded) = decode_png(&bytes);
            assert_eq!((info.width, info.height), (7, 4));
            assert_eq!(info.color_type, color);
            assert_eq!(info.bit_depth, png::BitDepth::Eight);
            assert_eq!(decoded, pixels, "{channels} channels");
        }
    }

    #[test]
    fn bad_image_shapes_are_errors() {
        assert!(matches!(
            encode_png(2, 2, 5, &[0; 20]),
            Err(ImageError::UnsupportedChannels { channels: 5 })
        ));
        assert!(matches!(
            encode_png(0, 2, 3, &[]),
            Err(ImageError::Empty {
                width: 0,
                height: 2
            })
        ));
        assert!(matches!(
            encode_png(2, 0, 1, &[]),
            Err(ImageError::Empty { .. })
        ));
        assert!(matches!(
            encode_png(2, 2, 3, &[0; 11]),
            Err(ImageError::PixelCountMismatch { len: 11, .. })
        ));
        assert!(matches!(
            encode_png(u32::MAX, 1, 1, &[0]),
            Err(ImageError::TooLarge { .. })
        ));
        let msg = encode_png(2, 2, 3, &[0; 11]).unwrap_err().to_string();
        assert!(
            msg.contains("2x2x3") && msg.contains("12") && msg.contains("11"),
            "{msg}"
        );
    }

    #[test]
    fn bad_image_leaves_batch_untouched() {
        let mut out = vec![1, 2, 3];
        let scalar = ScalarPoint {
            tag: "loss".into(),
            value: 1.0,
            step: 5,
        };
        let image = ImagePoint {
            tag: "vis".into(),
            step: 5,
            height: 2,
            width: 2,
            channels: 3,
            pixels: vec![0; 5],
        };
        let err = encode_events(&mut out, 0.0, &[scalar], &[image], &[], &[]).unwrap_err();
        assert_eq!(out, [1, 2, 3]);
        let Error::Image { tag, step, source } = &err else {
            panic!("expected an Image error, got {err:?}");
        };
        assert_eq!((tag.as_str(), *step), ("vis", Some(5)));
        assert!(matches!(*source, ImageError::PixelCountMismatch { .. }));
        assert!(err.to_string().starts_with("image 'vis' at iter 5: "));
    }

    #[test]
    fn error_can_cross_threads() {
        // The background writer thread hands errors back to the training thread.
        fn assert_send_sync<T: Send + Sync + 'static>() {}
        assert_send_sync::<Error>();
    }

    #[test]
    fn event_file_name_matches_torch() {
        assert_eq!(
            event_file_name(1_700_000_000, "node7", 4242, 0),
            "events.out.tfevents.1700000000.node7.4242.0"
        );
        assert_eq!(
            event_file_name(42, "h", 1, 3),
            "events.out.tfevents.0000000042.h.1.3"
        );
    }

    #[test]
    fn event_file_is_created_lazily() {
        let dir = scratch_dir("lazy").join("nested");
        let mut file = EventFile::new(dir.clone(), "events.out.tfevents.test".into());
        assert_eq!(file.path(), dir.join("events.out.tfevents.test"));
        assert!(!file.is_created());
        assert!(!dir.exists());

        file.append(&[]).unwrap();
        file.flush(true).unwrap();
        assert!(!file.is_created());
        assert!(!dir.exists());

        let mut records = Vec::new();
        let scalar = ScalarPoint {
            tag: "loss".into(),
            value: 0.5,
            step: 3,
        };
        encode_events(&mut records, 10.0, &[scalar], &[], &[], &[]).unwrap();
        file.append(&records).unwrap();
        file.append(&records).unwrap();
        file.flush(true).unwrap();
        assert!(file.is_created());

        let events = decode_events(&std::fs::read(file.path()).unwrap());
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].step, 0);
        assert!(events[0].wall_time > 0.0);
        assert_eq!(
            events[0].what,
            Some(event::What::FileVersion("brain.Event:2".into()))
        );
        assert_eq!(only_value(&events[1]).tag, "loss");
        assert_eq!(events[2].step, 3);

        // create_new: a second writer must not clobber the file.
        let mut other = EventFile::new(dir.clone(), "events.out.tfevents.test".into());
        assert!(other.append(&records).is_err());
        assert!(!other.is_created());

        std::fs::remove_dir_all(dir.parent().unwrap()).unwrap();
    }

    /// A file that accepts `room` more bytes, then fails like a full disk.
    struct FullAfter {
        inner: File,
        room: usize,
    }

    impl crate::append::AppendFile for FullAfter {
        fn write_once(&mut self, buf: &[u8]) -> io::Result<usize> {
            if self.room == 0 {
                return Err(io::Error::other("no space left on device (test)"));
            }
            let n = buf.len().min(self.room);
            self.room -= n;
            self.inner.write(&buf[..n])
        }
        fn position(&mut self) -> io::Result<u64> {
            self.inner.position()
        }
        fn real_len(&self) -> io::Result<u64> {
            self.inner.real_len()
        }
        fn truncate_to(&self, len: u64) -> io::Result<()> {
            self.inner.truncate_to(len)
        }
    }

    #[test]
    fn failed_write_is_truncated_away() {
        use crate::append::{append_units, record_ends, AppendFile};
        let dir = scratch_dir("rollback");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("events");
        let file = OpenOptions::new()
            .append(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        let first = file_version_record(1.0);
        let mut second = Vec::new();
        append_record(&mut second, &[7; 100]);
        // Room for the first record and part of the second: a torn write.
        let mut sink = FullAfter {
            inner: file,
            room: first.len() + 30,
        };
        let append = |sink: &mut FullAfter, data: &[u8]| {
            let start = sink.real_len().unwrap();
            append_units(sink, data, &record_ends(data), start)
        };

        append(&mut sink, &first).unwrap();
        let err = append(&mut sink, &second).unwrap_err();
        assert!(err.source.to_string().contains("no space left"), "{err:?}");
        assert_eq!(std::fs::read(&path).unwrap(), first);

        // Append mode: once space frees up, the next record lands right after the last
        // whole one, with no gap where the torn bytes were.
        sink.room = usize::MAX;
        append(&mut sink, &second).unwrap();
        let mut expected = first.clone();
        expected.extend_from_slice(&second);
        assert_eq!(std::fs::read(&path).unwrap(), expected);
        assert_eq!(read_records(&expected).len(), 2);

        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn dev_full_returns_the_write_error() {
        // /dev/full cannot be truncated; the write error (ENOSPC) must still come back.
        let path = std::path::Path::new("/dev/full");
        let Ok(mut full) = OpenOptions::new().append(true).open(path) else {
            return; // not on this platform
        };
        let err = append_records(&mut full, path, &file_version_record(1.0)).unwrap_err();
        assert!(
            matches!(&err, Error::Io { source, .. } if source.raw_os_error() == Some(28)),
            "{err}"
        ); // ENOSPC
    }

    #[test]
    fn event_sink_is_lazy() {
        let _serial = crate::writer::test_serial();
        let dir = scratch_dir("events-lazy").join("tb");
        let sink = EventSink::new(dir.clone(), "host", "", FsyncPolicy::Close);
        let path = sink.path();
        let mut h =
            crate::writer::SinkHandle::open(Box::new(sink), "TensorboardXWriter", path.clone())
                .unwrap();
        h.flush().unwrap();
        assert!(!dir.exists());
        let scalars = vec![ScalarPoint {
            tag: "loss".into(),
            value: 0.5,
            step: 3,
        }];
        h.send(Payload::Events {
            wall_time: 1.0,
            scalars,
            images: vec![],
            histograms: vec![],
            tensors: vec![],
        })
        .unwrap();
        h.close().unwrap();
        assert!(path.exists());
        assert!(path
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("events.out.tfevents."));
    }
}
