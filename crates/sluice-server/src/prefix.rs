//! Prefix reuse: a finished sequence's state is kept, with the tokens it holds, so a
//! later prompt that continues it (the next turn of a conversation: the earlier turns,
//! the reply, the new message) starts from it instead of computing those positions
//! again. Bounded by the bytes of the caches kept; the least recently kept go first.
//!
//! A state is taken whole, never shared or cut: sliding-window rings and recurrent
//! states cannot be rewound, so only a prompt that starts with *all* of a held
//! sequence's tokens reuses it.

use sluice_engine::{Backend, SeqState};

struct Held<B: Backend> {
    tokens: Vec<u32>,
    state: SeqState<B>,
    bytes: usize,
}

pub struct PrefixCache<B: Backend> {
    /// Oldest first.
    held: Vec<Held<B>>,
    budget: usize,
    bytes: usize,
}

impl<B: Backend> PrefixCache<B> {
    pub fn new(budget: usize) -> Self {
        PrefixCache { held: Vec::new(), budget, bytes: 0 }
    }

    /// Keeps a finished sequence's state (`tokens` are what it holds), dropping the
    /// oldest kept while over the budget.
    pub fn put(&mut self, tokens: Vec<u32>, state: SeqState<B>, bytes: usize) {
        if tokens.is_empty() || bytes > self.budget || tokens.len() != state.len() {
            return;
        }
        self.bytes += bytes;
        self.held.push(Held { tokens, state, bytes });
        while self.bytes > self.budget {
            let old = self.held.remove(0);
            self.bytes -= old.bytes;
        }
    }

    /// The held state whose tokens are the longest proper prefix of `prompt`, taken
    /// out of the cache, with those tokens.
    pub fn take(&mut self, prompt: &[u32]) -> Option<(SeqState<B>, Vec<u32>)> {
        let (i, _) = self
            .held
            .iter()
            .enumerate()
            .filter(|(_, h)| h.tokens.len() < prompt.len() && prompt.starts_with(&h.tokens))
            .max_by_key(|(_, h)| h.tokens.len())?;
        let h = self.held.remove(i);
        self.bytes -= h.bytes;
        Some((h.state, h.tokens))
    }
}
