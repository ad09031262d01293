//! The `tensorboard` tracker, with Accelerate's `TensorBoardTracker`
//! semantics: numbers become scalars, text becomes text summaries, and the
//! run config becomes hparams (one session, its end written on `finish`).
//! Event files are written by hand: TFRecord framing with masked CRC32C
//! around `Event`/`Summary` protobufs.

mod proto;
mod record;

use hearth_guest::{export_tracker, Entries, Start, Tracker, Value};
use proto::Message;
use std::collections::BTreeSet;
use std::fs::File;
use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

// Event fields.
const EVENT_WALL_TIME: u32 = 1;
const EVENT_STEP: u32 = 2;
const EVENT_FILE_VERSION: u32 = 3;
const EVENT_SUMMARY: u32 = 5;
// Summary / Summary.Value / SummaryMetadata / PluginData fields.
const SUMMARY_VALUE: u32 = 1;
const VALUE_TAG: u32 = 1;
const VALUE_SIMPLE: u32 = 2;
const VALUE_TENSOR: u32 = 8;
const VALUE_METADATA: u32 = 9;
const METADATA_PLUGIN_DATA: u32 = 1;
const PLUGIN_NAME: u32 = 1;
const PLUGIN_CONTENT: u32 = 2;
// TensorProto / TensorShapeProto.
const TENSOR_DTYPE: u32 = 1;
const TENSOR_SHAPE: u32 = 2;
const TENSOR_STRING_VAL: u32 = 8;
const SHAPE_DIM: u32 = 2;
const DIM_SIZE: u32 = 1;
const DT_STRING: i64 = 7;
// The hparams plugin (tensorboard/plugins/hparams/{plugin_data,api}.proto).
const HPARAMS_EXPERIMENT: u32 = 2;
const HPARAMS_SESSION_START: u32 = 3;
const HPARAMS_SESSION_END: u32 = 4;
const EXPERIMENT_HPARAM_INFOS: u32 = 4;
const EXPERIMENT_METRIC_INFOS: u32 = 5;
const HPARAM_INFO_NAME: u32 = 1;
const HPARAM_INFO_TYPE: u32 = 4;
const METRIC_INFO_NAME: u32 = 1;
const METRIC_NAME_TAG: u32 = 2;
const START_HPARAMS: u32 = 1;
const START_GROUP_NAME: u32 = 4;
const START_TIME: u32 = 5;
const END_STATUS: u32 = 1;
const END_TIME: u32 = 2;
const STATUS_SUCCESS: i64 = 1;
// google.protobuf.Value.
const NUMBER_VALUE: u32 = 2;
const STRING_VALUE: u32 = 3;
const BOOL_VALUE: u32 = 4;

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn plugin_metadata(plugin: &str, content: &[u8]) -> Message {
    let data = Message::default()
        .string(PLUGIN_NAME, plugin)
        .bytes(PLUGIN_CONTENT, content);
    Message::default().message(METADATA_PLUGIN_DATA, data)
}

fn scalar(tag: &str, v: f32) -> Message {
    Message::default()
        .string(VALUE_TAG, tag)
        .float(VALUE_SIMPLE, v)
}

fn text(tag: &str, s: &str) -> Message {
    let shape = Message::default().message(SHAPE_DIM, Message::default().int(DIM_SIZE, 1));
    let tensor = Message::default()
        .int(TENSOR_DTYPE, DT_STRING)
        .message(TENSOR_SHAPE, shape)
        .bytes(TENSOR_STRING_VAL, s.as_bytes());
    Message::default()
        .string(VALUE_TAG, tag)
        .message(VALUE_METADATA, plugin_metadata("text", &[]))
        .message(VALUE_TENSOR, tensor)
}

/// A summary value carrying one `HParamsPluginData` (version 0) with `field` set.
fn hparams(tag: &str, field: u32, data: Message) -> Message {
    let content = Message::default().int(1, 0).message(field, data).finish();
    Message::default()
        .string(VALUE_TAG, tag)
        .message(VALUE_METADATA, plugin_metadata("hparams", &content))
}

fn protobuf_value(v: &Value) -> (Message, i64) {
    // (google.protobuf.Value, hparams DataType)
    match v {
        Value::Float(f) => (Message::default().double(NUMBER_VALUE, *f), 3),
        Value::Int(i) => (Message::default().double(NUMBER_VALUE, *i as f64), 3),
        Value::Boolean(b) => (Message::default().int(BOOL_VALUE, *b as i64), 2),
        Value::Text(s) => (Message::default().string(STRING_VALUE, s), 1),
    }
}

#[derive(Default)]
struct TensorBoard {
    file: Option<File>,
    config: Entries,
    scalar_tags: BTreeSet<String>,
    last_step: u64,
}

impl TensorBoard {
    fn write_event(&mut self, step: u64, what: u32, payload: &[u8]) -> Result<(), String> {
        let file = self.file.as_mut().ok_or("log called before start")?;
        let event = Message::default()
            .double(EVENT_WALL_TIME, now())
            .int(EVENT_STEP, step as i64)
            .bytes(what, payload);
        file.write_all(&record::frame(&event.finish()))
            .map_err(|e| format!("writing the event file: {e}"))
    }

    fn write_summary(&mut self, step: u64, values: Vec<Message>) -> Result<(), String> {
        if values.is_empty() {
            return Ok(());
        }
        let summary = values
            .into_iter()
            .fold(Message::default(), |s, v| s.message(SUMMARY_VALUE, v));
        self.write_event(step, EVENT_SUMMARY, &summary.finish())
    }
}

impl Tracker for TensorBoard {
    fn start(&mut self, start: Start) -> Result<(), String> {
        let (run, config) = (start.run, start.config);
        // A fresh file per start (a restarted instance must not overwrite
        // earlier events; TensorBoard reads every event file in the folder).
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let name = format!(
            "/logs/events.out.tfevents.{}.hearth.{}",
            t.as_secs(),
            t.subsec_nanos()
        );
        self.file = Some(File::create(&name).map_err(|e| format!("{name}: {e}"))?);
        let file_version = b"brain.Event:2";
        self.write_event(0, EVENT_FILE_VERSION, file_version)?;

        let mut start = Message::default();
        for (name, value) in &config {
            let entry = Message::default()
                .string(1, name)
                .message(2, protobuf_value(value).0);
            start = start.message(START_HPARAMS, entry);
        }
        let start = start
            .string(START_GROUP_NAME, &run.run)
            .double(START_TIME, now());
        self.write_summary(
            0,
            vec![hparams(
                "_hparams_/session_start_info",
                HPARAMS_SESSION_START,
                start,
            )],
        )?;
        self.config = config;
        Ok(())
    }

    fn log(&mut self, step: u64, values: Entries) -> Result<(), String> {
        let mut summary = Vec::new();
        for (name, value) in &values {
            match value {
                Value::Float(v) => summary.push(scalar(name, *v as f32)),
                Value::Int(v) => summary.push(scalar(name, *v as f32)),
                Value::Boolean(v) => summary.push(scalar(name, f32::from(u8::from(*v)))),
                Value::Text(s) => summary.push(text(name, s)),
            }
            if !matches!(value, Value::Text(_)) {
                self.scalar_tags.insert(name.clone());
            }
        }
        self.last_step = self.last_step.max(step);
        self.write_summary(step, summary)?;
        Ok(())
    }

    fn finish(&mut self) -> Result<(), String> {
        if self.file.is_none() {
            return Ok(());
        }
        // The experiment: every config key, and every scalar logged as a
        // metric, so the HParams dashboard shows them side by side.
        let mut experiment = Message::default();
        for (name, value) in &self.config {
            let info = Message::default()
                .string(HPARAM_INFO_NAME, name)
                .int(HPARAM_INFO_TYPE, protobuf_value(value).1);
            experiment = experiment.message(EXPERIMENT_HPARAM_INFOS, info);
        }
        for tag in &self.scalar_tags {
            let name = Message::default().string(METRIC_NAME_TAG, tag);
            experiment = experiment.message(
                EXPERIMENT_METRIC_INFOS,
                Message::default().message(METRIC_INFO_NAME, name),
            );
        }
        let end = Message::default()
            .int(END_STATUS, STATUS_SUCCESS)
            .double(END_TIME, now());
        let step = self.last_step;
        self.write_summary(
            step,
            vec![
                hparams("_hparams_/experiment", HPARAMS_EXPERIMENT, experiment),
                hparams("_hparams_/session_end_info", HPARAMS_SESSION_END, end),
            ],
        )?;
        let mut file = self.file.take().expect("checked above");
        file.flush()
            .and_then(|_| file.sync_all())
            .map_err(|e| format!("closing the event file: {e}"))
    }
}

export_tracker!(TensorBoard);
