SELECT input_bucket,
       COUNT(ttft_ms) AS n,
       AVG(ttft_ms) AS mean_ttft_ms
FROM llm_inference_log
WHERE model = :model
  AND created_at >= :since_us
  AND ttft_ms IS NOT NULL
GROUP BY input_bucket
ORDER BY CASE input_bucket
           WHEN '0-128' THEN 0 WHEN '128-512' THEN 1
           WHEN '512-2048' THEN 2 WHEN '2048+' THEN 3 ELSE 4 END
