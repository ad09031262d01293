//! `hearth:plugin/delivery`: a tracker's account of what it delivered.

use super::super::tracker::hearth::plugin::delivery;
use crate::sandbox::{DeliveryCounts, PluginState};

impl delivery::Host for PluginState {
    /// Keeps the tracker's latest counts for its health (summary.json).
    fn report(&mut self, counts: delivery::Counts) {
        self.delivery = Some(DeliveryCounts {
            sent: counts.sent,
            retried: counts.retried,
            spooled: counts.spooled,
            dropped: counts.dropped,
        });
    }
}
