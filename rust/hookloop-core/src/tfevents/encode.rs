//! What is written for each value: the events of a batch of points, framed as TFRecords,
//! as torch's `SummaryWriter` writes them (legacy `simple_value` scalars, PNG images,
//! histograms with TensorBoard's bucket layout, text as a tensor with the text plugin's
//! metadata), and the file-version and purge events.

use prost::Message;

use super::image::{check_image_shape, encode_png};
use super::proto::{
    event, summary, summary_metadata, tensor_shape_proto, Event, HistogramProto, SessionLog,
    Summary, SummaryMetadata, TensorProto, TensorShapeProto, DT_STRING, SESSION_START,
};
use super::tfrecord::append_record;
use crate::error::{Error, ImageError, Result};
use crate::record::{HistogramPoint, ImagePoint, ScalarPoint, TensorPoint, TensorValue};

/// The `file_version` of every event file TensorBoard reads today.
pub const FILE_VERSION: &str = "brain.Event:2";

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

impl TensorPoint {
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

pub(super) fn append_event(out: &mut Vec<u8>, event: &Event) {
    append_record(out, &event.encode_to_vec());
}

pub(super) fn summary_event(wall_time: f64, step: i64, value: summary::Value) -> Event {
    Event {
        wall_time,
        step,
        what: Some(event::What::Summary(Summary { value: vec![value] })),
    }
}

/// A value with no plugin metadata (legacy scalars, images, histograms).
pub(super) fn plain_value(tag: &str, value: summary::value::Value) -> summary::Value {
    summary::Value {
        tag: tag.to_owned(),
        metadata: None,
        value: Some(value),
    }
}

pub(super) fn image_event(
    wall_time: f64,
    image: &ImagePoint,
) -> std::result::Result<Event, ImageError> {
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
