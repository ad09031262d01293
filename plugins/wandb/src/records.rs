//! The part of wandb's record schema (`wandb/proto/wandb_internal.proto`,
//! package `wandb_internal`) an offline run needs, with wandb's field
//! numbers. Values travel as JSON text (`value_json`), as wandb's own
//! client writes them; a key is one `nested_key` element, as it writes
//! them too.

use prost::Message;

/// One entry of a `.wandb` file. Exactly one of the optional records is set.
#[derive(Clone, PartialEq, Message)]
pub struct Record {
    /// Records are numbered from 1 in the order they are written.
    #[prost(int64, tag = "1")]
    pub num: i64,
    #[prost(message, optional, tag = "2")]
    pub history: Option<HistoryRecord>,
    #[prost(message, optional, tag = "3")]
    pub summary: Option<SummaryRecord>,
    #[prost(message, optional, tag = "5")]
    pub config: Option<ConfigRecord>,
    #[prost(message, optional, tag = "17")]
    pub run: Option<RunRecord>,
    #[prost(message, optional, tag = "18")]
    pub exit: Option<RunExitRecord>,
    #[prost(message, optional, tag = "21")]
    pub header: Option<HeaderRecord>,
    /// `_info`: which run's stream the record belongs to.
    #[prost(message, optional, tag = "200")]
    pub info: Option<RecordInfo>,
}

#[derive(Clone, PartialEq, Message)]
pub struct RecordInfo {
    #[prost(string, tag = "1")]
    pub stream_id: String,
}

/// The first record: who wrote the file.
#[derive(Clone, PartialEq, Message)]
pub struct HeaderRecord {
    #[prost(message, optional, tag = "1")]
    pub version_info: Option<VersionInfo>,
}

#[derive(Clone, PartialEq, Message)]
pub struct VersionInfo {
    #[prost(string, tag = "1")]
    pub producer: String,
    #[prost(string, tag = "2")]
    pub min_consumer: String,
}

/// The run: its id, project, name, config and start.
#[derive(Clone, PartialEq, Message)]
pub struct RunRecord {
    #[prost(string, tag = "1")]
    pub run_id: String,
    #[prost(string, tag = "2")]
    pub entity: String,
    #[prost(string, tag = "3")]
    pub project: String,
    #[prost(message, optional, tag = "4")]
    pub config: Option<ConfigRecord>,
    #[prost(string, tag = "8")]
    pub display_name: String,
    #[prost(string, tag = "13")]
    pub host: String,
    #[prost(message, optional, tag = "17")]
    pub start_time: Option<Timestamp>,
    #[prost(bool, tag = "18")]
    pub resumed: bool,
}

/// `google.protobuf.Timestamp`.
#[derive(Clone, PartialEq, Message)]
pub struct Timestamp {
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

#[derive(Clone, PartialEq, Message)]
pub struct ConfigRecord {
    #[prost(message, repeated, tag = "1")]
    pub update: Vec<ConfigItem>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ConfigItem {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "16")]
    pub value_json: String,
}

/// One `wandb.log` call: its values and its step.
#[derive(Clone, PartialEq, Message)]
pub struct HistoryRecord {
    #[prost(message, repeated, tag = "1")]
    pub item: Vec<Item>,
    #[prost(message, optional, tag = "2")]
    pub step: Option<HistoryStep>,
}

/// A history or summary value (`HistoryItem`, `SummaryItem`: the same
/// fields where an offline run uses them).
#[derive(Clone, PartialEq, Message)]
pub struct Item {
    #[prost(string, repeated, tag = "2")]
    pub nested_key: Vec<String>,
    #[prost(string, tag = "16")]
    pub value_json: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct HistoryStep {
    #[prost(int64, tag = "1")]
    pub num: i64,
}

/// The run's summary: the last value of each key.
#[derive(Clone, PartialEq, Message)]
pub struct SummaryRecord {
    #[prost(message, repeated, tag = "1")]
    pub update: Vec<Item>,
}

/// The last record of a finished run.
#[derive(Clone, PartialEq, Message)]
pub struct RunExitRecord {
    #[prost(int32, tag = "1")]
    pub exit_code: i32,
    /// Seconds the run took.
    #[prost(int32, tag = "2")]
    pub runtime: i32,
}
