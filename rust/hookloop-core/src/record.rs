//! The rows and points that flow from the storage to the writer threads: what `Storage` and
//! the writers hand over, and what each output format formats. Names only `iter` (a leaf), so
//! the storage, the generic writer thread and the formats all build on it.

use std::sync::Arc;

use crate::iter::Iter;

/// One iteration's scalars for metrics.json.
#[derive(Debug, Clone, PartialEq)]
pub struct JsonRow {
    pub iter: Iter,
    pub scalars: Vec<(Arc<str>, f64)>,
}

/// A scalar for TensorBoard's scalar dashboard. Stored as float32, as TensorBoard does.
#[derive(Debug, Clone, PartialEq)]
pub struct ScalarPoint {
    /// Series name.
    pub tag: Arc<str>,
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

/// A histogram for TensorBoard's histogram dashboard; TensorBoard's `HistogramProto`
/// holds the same buckets.
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
    ) -> Result<HistogramPoint, BucketMismatch> {
        if bucket_limits.len() != bucket_counts.len() {
            return Err(BucketMismatch {
                tag,
                limits: bucket_limits.len(),
                counts: bucket_counts.len(),
            });
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
}

/// A histogram whose bucket limits and counts do not pair up. The crate's `Error` converts it
/// (`BadValue`), which is where its message is spelled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketMismatch {
    pub tag: String,
    pub limits: usize,
    pub counts: usize,
}
