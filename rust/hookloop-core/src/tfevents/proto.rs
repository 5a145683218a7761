//! The `Event`/`Summary` protobuf messages: hand-written prost structs mirroring
//! tensorboard's `tensorboard/compat/proto/{event,summary,histogram,tensor,tensor_shape}.proto`.
//! Only the fields hookloop writes are declared; the field numbers are tensorboard's, so any
//! reader decodes them. Decoding a file written by someone else ignores the fields not
//! declared here.

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
