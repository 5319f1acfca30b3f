//! Stop strings: generated text is shown up to the first occurrence of any of them
//! and generation ends there (llama.cpp's reverse prompts).

/// Text streamed through it comes out up to the first stop string, withholding any
/// tail that might be the start of one until the next piece settles it.
pub struct StopText {
    stops: Vec<String>,
    pending: String,
    /// The stop string reached, once one is.
    matched: Option<usize>,
}

impl StopText {
    pub fn new(stops: Vec<String>) -> StopText {
        debug_assert!(stops.iter().all(|s| !s.is_empty()));
        StopText { stops, pending: String::new(), matched: None }
    }

    /// The text that can be shown now, and whether a stop string has been reached
    /// (nothing more is shown after it).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        if self.matched.is_some() {
            return (String::new(), true);
        }
        self.pending.push_str(piece);
        let first =
            self.stops.iter().enumerate().filter_map(|(i, s)| self.pending.find(s.as_str()).map(|at| (at, i))).min();
        if let Some((at, i)) = first {
            self.matched = Some(i);
            let shown = self.pending[..at].to_string();
            self.pending.clear();
            return (shown, true);
        }
        // Hold back the longest tail that begins some stop string.
        let hold = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).filter(|&k| s.is_char_boundary(k)).map(|k| &s[..k]))
            .filter(|p| self.pending.ends_with(p))
            .map(|p| p.len())
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - hold;
        let shown = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (shown, false)
    }

    /// The stop string that ended the text, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// What was held back, once generation has ended without reaching a stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut f = StopText::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (s, stop) = f.push(p);
            out += &s;
            if stop {
                return (out, true);
            }
        }
        out += &f.finish();
        (out, false)
    }

    #[test]
    fn stops_across_pieces_and_shows_what_came_before() {
        assert_eq!(run(&["\nUser:"], &[" Paris.", "\n", "Us", "er: next"]), (" Paris.".into(), true));
        assert_eq!(run(&["\nUser:"], &[" Paris.\nUser: x"]), (" Paris.".into(), true));
        // The earliest of several stop strings wins.
        assert_eq!(run(&["END", "\n\n"], &["a\n\nb END"]), ("a".into(), true));
        let mut f = StopText::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(f.push("a END\n\n"), ("a ".into(), true));
        assert_eq!(f.matched(), Some("END"));
    }

    #[test]
    fn a_held_back_prefix_is_released_when_it_goes_nowhere() {
        let mut f = StopText::new(vec!["\nUser:".into()]);
        assert_eq!(f.push("Paris\n"), ("Paris".into(), false));
        assert_eq!(f.push("Us"), ("".into(), false));
        assert_eq!(f.push("ually"), ("\nUsually".into(), false));
        assert_eq!(run(&["\nUser:"], &["a\nUs"]), ("a\nUs".into(), false));
        // Multi-byte text around a stop string that starts with a multi-byte char.
        assert_eq!(run(&["é!"], &["café", " ok"]), ("café ok".into(), false));
        assert_eq!(run(&["é!"], &["caf", "é", "!"]), ("caf".into(), true));
    }
}
