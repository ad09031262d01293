//! An online run: the calls wandb's own client makes to a W&B server
//! (`base-url`), authenticated with `WANDB_API_KEY` as HTTP basic auth
//! (`api:<key>`):
//!
//! - GraphQL `upsertBucket` makes the run (its id, project, entity,
//!   display name and config); the answer names the entity when the
//!   option leaves it to the key's default;
//! - `POST /files/<entity>/<project>/<id>/file_stream` sends history rows
//!   as lines of `wandb-history.jsonl` from the offset the server has, and
//!   at the end `wandb-summary.json` with `complete` and the exit code.
//!
//! Everything goes through the SDK's outbox, so a server that is down
//! costs the run nothing: the records wait in `/logs/outbox`, and the run
//! is made on the first request that gets through. The stream's entity,
//! project and offset are kept in `/logs/online-run` for a fresh instance
//! or a resumed run. One batch is one request, so a retried batch never
//! leaves half of it behind at a new offset.

use super::{json_object, Row, RunInfo};
use base64::Engine;
use hearth_guest::http::percent_encoded;
use hearth_guest::outbox::{Attempt, Outbox, Record, Settings};
use serde_json::{json, Value as Json};
use std::cell::RefCell;

const STREAM_FILE: &str = "/logs/online-run";

/// The mutation wandb's client sends, cut to the fields hearth fills.
const UPSERT_BUCKET: &str = "mutation UpsertBucket($name: String, $project: String, $entity: String, \
$displayName: String, $config: JSONString) { upsertBucket(input: {name: $name, modelName: $project, \
entityName: $entity, displayName: $displayName, config: $config}) { bucket { id name project { name \
entity { name } } } inserted } }";

/// Where the run's history goes on the server, and how much it has.
#[derive(Clone)]
struct Stream {
    /// The W&B run it belongs to.
    id: String,
    entity: String,
    project: String,
    offset: u64,
}

impl Stream {
    /// The stream kept for run `id` (another run's is not this one's).
    fn read(id: &str) -> Option<Self> {
        let doc: Json = serde_json::from_str(&std::fs::read_to_string(STREAM_FILE).ok()?).ok()?;
        (doc["id"].as_str()? == id).then_some(())?;
        Some(Stream {
            id: id.to_string(),
            entity: doc["entity"].as_str()?.to_string(),
            project: doc["project"].as_str()?.to_string(),
            offset: doc["offset"].as_u64()?,
        })
    }

    /// Keeps it for a fresh instance; a failure is said, not a reason to
    /// count delivered rows as lost.
    fn keep(&self) {
        let doc = json!({"id": self.id, "entity": self.entity, "project": self.project, "offset": self.offset});
        if let Err(e) = hearth_guest::files::write_atomically(STREAM_FILE, &doc.to_string()) {
            hearth_guest::log::warn(&format!(
                "{STREAM_FILE}: {e}; a fresh instance would start this run's history anew"
            ));
        }
    }
}

struct Api {
    base: String,
    auth: String,
    run: RunInfo,
    stream: RefCell<Option<Stream>>,
}

impl Api {
    fn post(&self, path: &str, body: &Json) -> Result<Vec<u8>, Attempt> {
        let headers = [
            ("content-type", "application/json"),
            ("authorization", self.auth.as_str()),
        ];
        let url = format!("{}{path}", self.base);
        let reply = hearth_guest::http::post(&url, &headers, body.to_string().as_bytes())
            .map_err(|e| Attempt::Retry(format!("{path}: {e}")))?;
        match Attempt::from_status(reply.status, &reply.body) {
            Attempt::Sent => Ok(reply.body),
            Attempt::Retry(why) => Err(Attempt::Retry(format!("{path} {why}"))),
            Attempt::Refused(why) => Err(Attempt::Refused(format!("{path} {why}"))),
        }
    }

    /// The stream: kept, read back, or made now with `upsertBucket`.
    fn stream(&self) -> Result<Stream, Attempt> {
        if let Some(stream) = (self.stream.borrow().clone()).or_else(|| Stream::read(&self.run.id))
        {
            return Ok(stream);
        }
        let config = json_object(&self.run.config.iter().cloned().collect(), |v| {
            format!("{{\"value\":{v}}}")
        });
        let entity = Some(&self.run.entity).filter(|e| !e.is_empty());
        let variables = json!({
            "name": self.run.id,
            "project": self.run.project,
            "entity": entity,
            "displayName": self.run.name,
            "config": config,
        });
        let body = self.post(
            "/graphql",
            &json!({"query": UPSERT_BUCKET, "variables": variables}),
        )?;
        let answer: Json = serde_json::from_slice(&body)
            .map_err(|e| Attempt::Refused(format!("upsertBucket answered no JSON: {e}")))?;
        if let Some(errors) = answer.get("errors").filter(|e| !e.is_null()) {
            return Err(Attempt::Refused(format!("upsertBucket: {errors}")));
        }
        let project = &answer["data"]["upsertBucket"]["bucket"]["project"];
        let (Some(name), Some(entity)) =
            (project["name"].as_str(), project["entity"]["name"].as_str())
        else {
            return Err(Attempt::Refused(format!(
                "upsertBucket answered no project and entity: {answer}"
            )));
        };
        let stream = Stream {
            id: self.run.id.clone(),
            entity: entity.to_string(),
            project: name.to_string(),
            offset: 0,
        };
        stream.keep();
        *self.stream.borrow_mut() = Some(stream.clone());
        Ok(stream)
    }

    /// One batch of records as one `file_stream` request.
    fn send(&self, records: &[Record]) -> Attempt {
        match self.send_all(records) {
            Ok(()) => Attempt::Sent,
            Err(attempt) => attempt,
        }
    }

    fn send_all(&self, records: &[Record]) -> Result<(), Attempt> {
        let mut stream = self.stream()?;
        let rows: Vec<&str> = records
            .iter()
            .filter_map(|r| r.line.strip_prefix("row "))
            .collect();
        let summary = records.iter().find_map(|r| r.line.strip_prefix("exit "));
        if rows.is_empty() && summary.is_none() {
            return Ok(());
        }
        let mut files = serde_json::Map::new();
        if !rows.is_empty() {
            files.insert(
                "wandb-history.jsonl".into(),
                json!({"offset": stream.offset, "content": rows}),
            );
        }
        let mut body = json!({});
        if let Some(summary) = summary {
            files.insert(
                "wandb-summary.json".into(),
                json!({"offset": 0, "content": [summary]}),
            );
            body["complete"] = json!(true);
            body["exitcode"] = json!(0);
        }
        body["files"] = Json::Object(files);
        let path = format!(
            "/files/{}/{}/{}/file_stream",
            percent_encoded(&stream.entity),
            percent_encoded(&stream.project),
            percent_encoded(&self.run.id)
        );
        self.post(&path, &body)?;
        stream.offset += rows.len() as u64;
        *self.stream.borrow_mut() = Some(stream.clone());
        stream.keep();
        Ok(())
    }
}

/// A run on a W&B server, fed through an outbox.
pub struct Online {
    api: Api,
    outbox: Outbox,
}

impl Online {
    /// Opens the outbox (sending what an earlier instance spooled) and
    /// makes the run.
    pub fn start(
        base: String,
        key: String,
        run: RunInfo,
        settings: Settings,
    ) -> Result<Self, String> {
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(format!("base-url {base:?}: an http(s):// URL"));
        }
        let auth = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("api:{key}"))
        );
        let api = Api {
            base: base.trim_end_matches('/').to_string(),
            auth,
            run,
            stream: RefCell::new(None),
        };
        let mut outbox = Outbox::open("/logs/outbox", settings)?;
        outbox.push_now(Record::new(0, "upsert"), |r: &[Record]| api.send(r));
        Ok(Self { api, outbox })
    }

    /// Queues one history row of `values` logged values.
    pub fn row(&mut self, values: u64, row: &Row) {
        let line = format!("row {}", json_object(row, str::to_string));
        let api = &self.api;
        self.outbox
            .push(Record::new(values, line), |r: &[Record]| api.send(r));
    }

    /// Queues the summary and the end, and sends what waits, for a bounded time.
    pub fn finish(&mut self, summary: &Row) {
        let line = format!("exit {}", json_object(summary, str::to_string));
        let api = &self.api;
        self.outbox
            .push_now(Record::new(0, line), |r: &[Record]| api.send(r));
        self.outbox.flush(|r: &[Record]| api.send(r));
    }
}
